import pytest

from graphopt.executor.numerics import CONV_ENV, GEMM_ENV, GEMM_RNZ_ENV, reset_env_warnings


@pytest.fixture(autouse=True)
def clean_fp16_env(monkeypatch):
    """Every test starts with the three library variables unset and no warning remembered."""
    for name in (GEMM_ENV, GEMM_RNZ_ENV, CONV_ENV):
        monkeypatch.delenv(name, raising=False)
    reset_env_warnings()
    yield
    reset_env_warnings()

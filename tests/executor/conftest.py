"""Fixtures of the executor's tests."""

import pytest

from graphopt.executor.kernels import _compiled


@pytest.fixture(params=["numpy", "compiled"])
def kernel_path(request, monkeypatch):
    """Runs a test on the NumPy passes and on the compiled kernels (at every size, not only
    from _compiled.MIN_ELEMENTS on); yields the path's name."""
    if request.param == "numpy":
        monkeypatch.setenv(_compiled.ENV_SWITCH, "0")
    else:
        pytest.importorskip("numba")
        monkeypatch.setenv(_compiled.ENV_SWITCH, "1")
        monkeypatch.setattr(_compiled, "MIN_ELEMENTS", 0)
    return request.param

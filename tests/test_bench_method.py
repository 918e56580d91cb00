"""bench/_common.py enforces the benchmarks' publishing rule: a section is written to RESULTS.md
only when the load average was at most 1 per core and the OpenBLAS overrides were unset."""

import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench" / "_common.py"


@pytest.fixture()
def common():
    spec = importlib.util.spec_from_file_location("bench_common", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_loaded_machine_writes_nothing(common, tmp_path, monkeypatch):
    results = tmp_path / "RESULTS.md"
    results.write_text("# Benchmark results\n")
    monkeypatch.delenv("OPENBLAS_CORETYPE", raising=False)
    monkeypatch.delenv("OPENBLAS_L2_SIZE", raising=False)
    monkeypatch.setattr(common, "LOAD_BEFORE", common.CORES + 0.5)
    with pytest.raises(SystemExit) as exit_info:
        common.write_section("X", "figures", results)
    assert exit_info.value.code == 3
    assert results.read_text() == "# Benchmark results\n"


def test_openblas_overrides_block_publishing_and_are_dropped_for_workers(common, monkeypatch):
    monkeypatch.setenv("OPENBLAS_CORETYPE", "Haswell")
    assert "OPENBLAS_CORETYPE" in common.publish_refusal(0.0)
    assert "OPENBLAS_CORETYPE" not in common.bench_env()
    monkeypatch.delenv("OPENBLAS_CORETYPE")
    monkeypatch.delenv("OPENBLAS_L2_SIZE", raising=False)
    monkeypatch.setattr(common, "LOAD_BEFORE", 0.0)
    assert common.publish_refusal(0.0) is None
    assert common.publish_refusal(common.CORES + 1.0) is not None


def test_a_quiet_run_writes_its_section_with_load_and_blas(common, tmp_path, monkeypatch):
    results = tmp_path / "RESULTS.md"
    monkeypatch.delenv("OPENBLAS_CORETYPE", raising=False)
    monkeypatch.delenv("OPENBLAS_L2_SIZE", raising=False)
    monkeypatch.setattr(common, "LOAD_BEFORE", 0.0)
    monkeypatch.setattr(common.os, "getloadavg", lambda: (0.1, 0.1, 0.1))
    common.write_section("X", "figures", results)
    text = results.read_text()
    assert "## X\n\nfigures\nLoad average (1 min): 0.00 before, 0.10 after" in text
    assert "BLAS:" in text

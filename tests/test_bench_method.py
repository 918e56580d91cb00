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


def test_loads_at_each_process_start_decide_and_a_loaded_start_refuses(common, monkeypatch):
    monkeypatch.delenv("OPENBLAS_CORETYPE", raising=False)
    monkeypatch.delenv("OPENBLAS_L2_SIZE", raising=False)
    monkeypatch.setattr(common, "LOAD_BEFORE", 0.0)
    # the benchmark's own last run makes the load after; the starts were quiet
    assert common.publish_refusal(common.CORES + 1.0, [0.5, common.CORES - 0.1]) is None
    assert "started" in common.publish_refusal(0.0, [0.5, common.CORES + 0.5])
    lines = common.method_lines(0.3, [0.5, 1.25])
    assert "at most 1.25 at a timed process's start" in lines[0]


def test_settle_waits_for_the_load_to_fall_to_one_per_core_and_gives_up(common, monkeypatch):
    loads = iter([common.CORES + 2.0, common.CORES + 1.0, common.CORES - 0.5])
    monkeypatch.setattr(common.os, "getloadavg", lambda: (next(loads), 0.0, 0.0))
    slept = []
    monkeypatch.setattr(common.time, "sleep", slept.append)
    assert common.settle(limit_s=60, poll_s=5) == common.CORES - 0.5
    assert slept == [5, 5]
    monkeypatch.setattr(common.os, "getloadavg", lambda: (common.CORES + 3.0, 0.0, 0.0))
    clock = iter(range(0, 1000, 30))
    monkeypatch.setattr(common.time, "monotonic", lambda: next(clock))
    assert common.settle(limit_s=60, poll_s=5) == common.CORES + 3.0  # never settled


def test_the_published_command_leaves_out_where_files_and_interpreters_live(common):
    line = common.command_line("bench_x.py", ["--cache", "/tmp/c", "--models", "a",
                                               "--graphopt-python=/v/bin/python", "--runs", "9"])
    assert line.endswith("python bench/bench_x.py --models a --runs 9")

"""Hostile inputs (tests/robustness/make_hostile_corpus.py) through the real CLI, in subprocesses.

For every case, `graphopt optimize FILE -o OUT` (and `graphopt run FILE --steps 1`, once the
command exists; OUT and more options as the case says, e.g. -o onto the model's own data
file) must: exit 1; print exactly one line on stderr, starting with
"graphopt: error:"; print no traceback; write nothing (no output, no temporary file, nothing
in the model's folder or the working directory); and read nothing outside the model's folder
(a sentinel outside, whose access time is set in the past, must keep it).

The CLI runs are done once per session, a few at a time, and the tests check the results.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import onnx
import pytest

from . import make_hostile_corpus

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
GRAPHOPT = os.path.join(os.path.dirname(sys.executable), "graphopt")
CLI = [GRAPHOPT] if os.path.exists(GRAPHOPT) else [sys.executable, "-P", "-m", "graphopt.cli"]
OLD = 1_000_000_000  # 2001: an access time a read would move (relatime updates older ones)


corpus_module = make_hostile_corpus
_BUILD_DIR = tempfile.mkdtemp(prefix="graphopt-hostile-")
CORPUS = corpus_module.make(os.path.join(_BUILD_DIR, "corpus"),
                            truncations=int(os.environ.get("GRAPHOPT_HOSTILE_TRUNCATIONS", 8)))
CASES = {case["name"]: case for case in CORPUS.cases}

# Known, open bugs (strict: fixing one makes its test fail until the entry is removed).
OPTIMIZE_BUGS: dict[str, str] = {}
RUN_BUGS: dict[str, str] = {}  # same convention as OPTIMIZE_BUGS


def _listing(folder: str) -> dict[str, tuple]:
    """Every entry under ``folder`` (links not followed) with size and mtime."""
    found = {}
    for dirpath, dirnames, filenames in os.walk(folder):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            st = os.lstat(path)
            found[os.path.relpath(path, folder)] = (st.st_size, st.st_mtime_ns)
    return found


def _atime_works(folder: str) -> bool:
    probe = os.path.join(folder, "atime-probe")
    with open(probe, "wb") as f:
        f.write(b"x")
    os.utime(probe, (OLD, time.time()))
    with open(probe, "rb") as f:
        f.read()
    works = os.stat(probe).st_atime > OLD + 10
    os.unlink(probe)
    return works


def _run_case(case: dict, argv_tail: list[str], scratch: str) -> dict:
    model = os.path.join(CORPUS.root, case["model"])
    folder = os.path.join(CORPUS.root, case["name"])
    out_dir = os.path.join(scratch, case["name"], "out")
    cwd = os.path.join(scratch, case["name"], "cwd")
    os.makedirs(out_dir)
    os.makedirs(cwd)
    before = _listing(folder)
    out = (os.path.join(folder, case["output"]) if "output" in case
           else os.path.join(out_dir, "optimized.onnx"))
    argv = [a.replace("{OUT}", out).replace("{CASE}", folder)
            for a in [*argv_tail, *case.get("args", {}).get(argv_tail[0], [])]]
    proc = subprocess.run([*CLI, argv[0], model, *argv[1:]], capture_output=True, text=True,
                          cwd=cwd, timeout=120)
    return {"rc": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr,
            "out_dir": out_dir,
            "folder_before": before, "folder_after": _listing(folder),
            "out_after": _listing(out_dir), "cwd_after": _listing(cwd)}


def _run_all(argv_tail: list[str]) -> dict[str, dict]:
    scratch = tempfile.mkdtemp(prefix="graphopt-hostile-run-", dir=_BUILD_DIR)
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        futures = {name: pool.submit(_run_case, case, argv_tail, scratch)
                   for name, case in CASES.items() if argv_tail[0] in case["commands"]}
        return {name: f.result() for name, f in futures.items()}


def _sentinel() -> str:
    return os.path.join(CORPUS.root, corpus_module.SENTINEL)


def _results_with_sentinel(argv_tail):
    sentinel = _sentinel()
    atime_checked = _atime_works(_BUILD_DIR)
    os.utime(sentinel, (OLD, time.time()))
    results = _run_all(argv_tail)
    read = os.stat(sentinel).st_atime > OLD + 10 if atime_checked else None
    return results, read


@pytest.fixture(scope="module")
def optimize_results():
    return _results_with_sentinel(["optimize", "-o", "{OUT}"])


def _run_available() -> bool:
    try:
        return subprocess.run([*CLI, "run", "--help"], capture_output=True,
                              timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.fixture(scope="module")
def run_results(tmp_path_factory):
    if not _run_available():
        pytest.skip("`graphopt run` does not exist yet")
    data = tmp_path_factory.mktemp("run-data") / "data.npz"
    np.savez(data, x=np.ones((4, 2, 4), np.float32))
    return _results_with_sentinel(["run", "--steps", "1", "--batch-size", "2", "--device",
                                   "cpu", "--data", str(data), "--loss", "output", "-o",
                                   "{OUT}"])


def _check(result: dict, case: dict, command: str = "optimize") -> None:
    stderr_lines = result["stderr"].strip().splitlines()
    shown = f"rc={result['rc']} stderr={result['stderr'][-600:]!r}"
    assert "Traceback" not in result["stderr"] + result["stdout"], shown
    if command in case.get("accepts", ()):  # a trap, not garbage: succeed, write a valid model
        _check_accepted(result, shown)
        return
    assert result["rc"] == 1, shown
    assert len(stderr_lines) == 1 and stderr_lines[0].startswith("graphopt: error:"), shown
    assert result["out_after"] == {}, f"left in the output folder: {result['out_after']}"
    assert result["cwd_after"] == {}, f"written to the working directory: {result['cwd_after']}"
    assert result["folder_after"] == result["folder_before"], "the model's folder changed"
    if case["escapes"]:
        assert "outside the model's folder" in stderr_lines[0], shown


def _check_accepted(result: dict, shown: str) -> None:
    assert result["rc"] == 0, shown
    assert list(result["out_after"]) == ["optimized.onnx"], result["out_after"]
    assert result["cwd_after"] == {}, f"written to the working directory: {result['cwd_after']}"
    assert result["folder_after"] == result["folder_before"], "the model's folder changed"
    written = os.path.join(result["out_dir"], "optimized.onnx")
    onnx.checker.check_model(onnx.load(written), full_check=True)


def _params(bugs: dict[str, str], command: str, strict: bool = True):
    return [pytest.param(name, marks=pytest.mark.xfail(strict=strict, reason=bugs[name]))
            if name in bugs else name for name in CASES if command in CASES[name]["commands"]]


@pytest.mark.parametrize("name", _params(OPTIMIZE_BUGS, "optimize"))
def test_optimize_refuses_hostile_file(optimize_results, name):
    _check(optimize_results[0][name], CASES[name])


def _assert_read_nothing_outside(results, command: str):
    read = results[1]
    if read is None:
        pytest.skip("this filesystem does not update access times")
    assert not read, f"some `graphopt {command}` run read the sentinel outside the model folders"


def test_optimize_reads_nothing_outside_the_model_folder(optimize_results):
    _assert_read_nothing_outside(optimize_results, "optimize")


@pytest.mark.parametrize("name", _params(RUN_BUGS, "run"))
def test_run_refuses_hostile_file(run_results, name):
    _check(run_results[0][name], CASES[name], "run")


def test_run_reads_nothing_outside_the_model_folder(run_results):
    _assert_read_nothing_outside(run_results, "run")


def test_corpus_manifest_lists_every_case():
    with open(os.path.join(CORPUS.root, "manifest.json")) as f:
        manifest = json.load(f)
    assert len(manifest["cases"]) == len(CASES) >= 50
    assert sum(case["escapes"] for case in manifest["cases"]) >= 6


def test_the_full_corpus_holds_the_cases_reliability_md_counts(tmp_path):
    """docs/reliability.md counts the corpus at its default 24 truncation points: 107 cases
    for optimize, 116 for run (CI makes it with GRAPHOPT_HOSTILE_TRUNCATIONS, 8: 91 and 100)."""
    full = corpus_module.make(str(tmp_path / "corpus"))
    commands = [case.get("commands") or ["optimize", "run"] for case in full.cases]
    assert (sum("optimize" in c for c in commands), sum("run" in c for c in commands)) == \
        (107, 116)


def teardown_module(module):
    shutil.rmtree(_BUILD_DIR, ignore_errors=True)

"""Wall time of ``graphopt run --example mqa`` (the default 300 steps, to the end of
training) on this tree and on a baseline commit, each run in a process of its own, the two
taking turns (see _common for the method). Writes its section of bench/RESULTS.md.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/bench_run_example.py \\
        [--baseline 1342e4c] [--runs 9] [--steps N] [--no-write]

The baseline is extracted with ``git archive`` into a temporary folder and run from there
(default: 1342e4c, the code before the CPU speed-ups: its layout, with symlinks, runs from its
source folder). This tree runs only as an installed package, so it is built and installed
(pip, no dependencies) into a temporary folder first. Each run gets its code through
PYTHONPATH, not from whatever graphopt this environment has installed; both use this
environment's Python and packages, and a neutral working folder.

Both run with bytecode caches, as an installed package or a used checkout does: pip compiles
this tree's modules when it installs them; the baseline's are written by its warm-up run,
which is why ``PYTHONDONTWRITEBYTECODE`` (set on some machines) is dropped for the runs, and
the script checks after the warm-up that every graphopt module either imports has its cache
(otherwise the one without pays ~0.5 s of compiling in every run).
"""
from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import MIN_RUNS, bench_env, command_line, install_tree, machine, med_min, publish

SECTION = "`graphopt run --example mqa` wall time"
REPO = Path(__file__).resolve().parent.parent
BASELINE = "1342e4c"


def _extract(commit: str, folder: str) -> None:
    archive = subprocess.run(["git", "-C", str(REPO), "archive", commit], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", folder], input=archive, check=True)


def _timed_run(code: str, cwd: str, steps: int | None) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one ``graphopt run --example mqa`` whose graphopt is
    the one in the folder ``code``."""
    env = _run_env(code)
    command = [sys.executable, "-P", "-m", "graphopt", "run", "--example", "mqa"]
    if steps is not None:
        command += ["--steps", str(steps)]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run(command, cwd=cwd, env=env, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.PIPE)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def _run_env(code: str) -> dict[str, str]:
    """The benchmark environment for a run of the graphopt in ``code``, writing bytecode
    caches as Python does by default."""
    env = {k: v for k, v in bench_env().items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPATH"] = code
    return env


# runs one step of ``graphopt run --example mqa`` in this process (its output discarded), then
# names each graphopt module it imported whose bytecode cache is missing or older than its source
_UNCACHED_PROBE = """
import contextlib, importlib.util, io, os, runpy, sys
sys.argv = ["graphopt", "run", "--example", "mqa", "--steps", "1"]
with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
    try:
        runpy.run_module("graphopt", run_name="__main__")
    except SystemExit as done:
        if done.code:
            raise
for name, module in sorted(sys.modules.items()):
    source = getattr(module, "__file__", None) or ""
    if name.split(".")[0] != "graphopt" or not source.endswith(".py"):
        continue
    cache = importlib.util.cache_from_source(source)
    if not os.path.exists(cache) or os.path.getmtime(cache) < os.path.getmtime(source):
        print(name)
"""


def _check_cached(trees: dict[str, str], cwd: str) -> None:
    """After the warm-up, every graphopt module a run imports has its bytecode cache."""
    for name, code in trees.items():
        env = {**_run_env(code), "PYTHONDONTWRITEBYTECODE": "1"}  # the probe writes none
        done = subprocess.run([sys.executable, "-P", "-c", _UNCACHED_PROBE], env=env, cwd=cwd,
                              capture_output=True, text=True)
        if done.returncode != 0 or done.stdout.strip():
            raise SystemExit(f"{name}: modules without a bytecode cache after the warm-up "
                             f"run (each run would compile them):\n{done.stdout}{done.stderr}")


def _check_runs_from(trees: dict[str, str]) -> None:
    """Each contender must import graphopt (and its executor) from its own folder."""
    probe = ("import graphopt.executor, os; "
             "print(os.path.realpath(graphopt.__file__)); "
             "print(os.path.realpath(graphopt.executor.__file__))")
    for name, code in trees.items():
        done = subprocess.run([sys.executable, "-P", "-c", probe], env={**bench_env(),
                              "PYTHONPATH": code}, capture_output=True, text=True)
        real = os.path.realpath(code) + os.sep
        files = done.stdout.split()
        if done.returncode != 0 or len(files) != 2 or not all(f.startswith(real) for f in files):
            raise SystemExit(f"{name}: graphopt is not imported from {code}:\n"
                             f"{done.stdout}{done.stderr}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", default=BASELINE, help="commit to compare with")
    parser.add_argument("--runs", type=int, default=MIN_RUNS)
    parser.add_argument("--no-write", action="store_true", help="do not update bench/RESULTS.md")
    parser.add_argument("--steps", type=int, default=None,
                        help="fewer steps than the example's 300 (a quick check of the script)")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        baseline, work = Path(folder, "baseline"), Path(folder, "work")
        baseline.mkdir()
        work.mkdir()
        _extract(args.baseline, str(baseline))
        trees = {"baseline": str(baseline),
                 "this tree": install_tree(REPO, Path(folder, "this-tree"))}
        _check_runs_from(trees)
        walls = {name: [] for name in trees}
        cpus = {name: [] for name in trees}
        for code in trees.values():  # warm-up: bytecode caches, page cache
            _timed_run(code, str(work), args.steps)
        _check_cached(trees, str(work))
        for i in range(args.runs):
            for name, code in trees.items():
                wall, cpu = _timed_run(code, str(work), args.steps)
                walls[name].append(wall)
                cpus[name].append(cpu)
                print(f"run {i + 1}/{args.runs} {name}: {wall:.2f} s wall, {cpu:.2f} s CPU",
                      flush=True)
    stats = {name: (med_min(walls[name], 1), med_min(cpus[name], 1)) for name in trees}
    # the baseline is named once, in the command line (given or the default)
    shown = list(sys.argv[1:] if argv is None else argv)
    if not any(a == "--baseline" or a.startswith("--baseline=") for a in shown):
        shown = ["--baseline", args.baseline, *shown]
    (b_med, b_min), (b_cpu, _) = stats["baseline"]
    (t_med, t_min), (t_cpu, _) = stats["this tree"]
    steps = "" if args.steps is None else f" --steps {args.steps}"
    what = "300 AdamW steps, " if args.steps is None else "AdamW, "
    lines = [
        f"`graphopt run --example mqa{steps}` (defaults: {what}batch 32, float32), process "
        f"start to exit, stdout discarded; each run a process of its own, baseline and this "
        f"tree taking turns, one warm-up run each, then {args.runs} runs each; both with "
        "bytecode caches (checked after the warm-up).",
        "",
        "| code | median s | min s | median CPU s (user + sys) |",
        "|---|---|---|---|",
        f"| baseline (the tree given by `--baseline`) | {b_med:.2f} | {b_min:.2f} | "
        f"{b_cpu:.2f} |",
        f"| this tree | {t_med:.2f} | {t_min:.2f} | {t_cpu:.2f} |",
        "",
        f"Speed-up: {b_med / t_med:.2f}x on the medians, {b_min / t_min:.2f}x on the minimums "
        "(target >= 2x).",
        f"Machine: {machine()}.",
        f"Command: `{command_line('bench_run_example.py', shown)}`",
    ]
    publish(SECTION, lines, write=not args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())

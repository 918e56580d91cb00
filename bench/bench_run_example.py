"""Wall time of ``graphopt run --example mqa`` (the default 300 steps, to the end of
training) on this tree and on a baseline commit, each run in a process of its own, the two
taking turns (see _common for the method). Writes its section of bench/RESULTS.md.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/bench_run_example.py \\
        [--baseline 1342e4c] [--runs 9]

The baseline is extracted with ``git archive`` into a temporary folder and run from there
(default: 1342e4c, the code before issue 15's work). Both runs use this Python environment.
"""
from __future__ import annotations

import argparse
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import MIN_RUNS, bench_env, command_line, machine, med_min, publish

SECTION = "`graphopt run --example mqa` wall time (issue 15)"
REPO = Path(__file__).resolve().parent.parent
BASELINE = "1342e4c"


def _extract(commit: str, folder: str) -> None:
    archive = subprocess.run(["git", "-C", str(REPO), "archive", commit], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", folder], input=archive, check=True)


def _timed_run(tree: str) -> tuple[float, float]:
    """(wall seconds, CPU seconds) of one ``graphopt run --example mqa`` from ``tree``."""
    env = bench_env()
    env["PYTHONPATH"] = tree
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-P", "-m", "graphopt", "run", "--example", "mqa"], cwd=tree,
                   env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return wall, cpu


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--baseline", default=BASELINE, help="commit to compare with")
    parser.add_argument("--runs", type=int, default=MIN_RUNS)
    parser.add_argument("--no-write", action="store_true", help="do not update bench/RESULTS.md")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as folder:
        _extract(args.baseline, folder)
        trees = {"baseline": folder, "this tree": str(REPO)}
        walls = {name: [] for name in trees}
        cpus = {name: [] for name in trees}
        for tree in trees.values():  # warm-up: bytecode caches, page cache
            _timed_run(tree)
        for i in range(args.runs):
            for name, tree in trees.items():
                wall, cpu = _timed_run(tree)
                walls[name].append(wall)
                cpus[name].append(cpu)
                print(f"run {i + 1}/{args.runs} {name}: {wall:.2f} s wall, {cpu:.2f} s CPU",
                      flush=True)
    head = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"],
                          capture_output=True, text=True).stdout.strip()
    stats = {name: (med_min(walls[name], 1), med_min(cpus[name], 1)) for name in trees}
    (b_med, b_min), (b_cpu, _) = stats["baseline"]
    (t_med, t_min), (t_cpu, _) = stats["this tree"]
    lines = [
        "`graphopt run --example mqa` (defaults: 300 AdamW steps, batch 32, float32), process "
        f"start to exit, stdout discarded; each run a process of its own, baseline and this "
        f"tree taking turns, one warm-up run each, then {args.runs} runs each.",
        "",
        "| code | median s | min s | median CPU s (user + sys) |",
        "|---|---|---|---|",
        f"| baseline {args.baseline} | {b_med:.2f} | {b_min:.2f} | {b_cpu:.2f} |",
        f"| this tree ({head}) | {t_med:.2f} | {t_min:.2f} | {t_cpu:.2f} |",
        "",
        f"Speed-up: {b_med / t_med:.2f}x on the medians, {b_min / t_min:.2f}x on the minimums "
        "(target >= 2x).",
        f"Machine: {machine()}.",
        f"Command: `{command_line('bench_run_example.py', argv)}`",
    ]
    publish(SECTION, lines, write=not args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())

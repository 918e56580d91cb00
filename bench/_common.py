"""What every benchmark here shares: the timing method and its section of RESULTS.md.

The method: each runtime is timed in a process of its own (thread pools of two runtimes in
one process steal each other's cores), after a warm-up, and reported as the median and the
minimum of at least MIN_RUNS runs; numpy runs as its users run it, so the benchmark
processes get an environment without OPENBLAS_CORETYPE and OPENBLAS_L2_SIZE (this machine
sets them for old OpenBLAS builds) and the BLAS kernel they run is printed (threadpoolctl);
the load average is recorded before and after, and a section is not written to RESULTS.md
when it is above 1 per core (then the figures are noise from other processes).
"""
from __future__ import annotations

import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).with_name("RESULTS.md")
MIN_RUNS = 9
# untimed steps before a training step is timed: a session's first runs learn where its
# mid-size products run faster (3 runs on one BLAS thread, 3 on BLAS's threads; see
# executor/blas_threads.py), and a training job runs for thousands of steps after them
STEP_WARMUP = 10
BLAS_VARS = ("OPENBLAS_CORETYPE", "OPENBLAS_L2_SIZE")
THREAD_VARS = ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")
CORES = os.cpu_count() or 1
LOAD_BEFORE = os.getloadavg()[0]  # scripts import this module before they do any work


def interleaved_medians(fns: dict, runs: int, warmup: bool = True) -> dict:
    """Median seconds per contender; contenders take turns within each round so that load
    from other processes on a shared machine hits all of them alike. Only for contenders
    that are the same runtime (one process is then fair): others go through ``in_processes``."""
    times = interleaved_times(fns, runs, warmup)
    return {name: statistics.median(t) for name, t in times.items()}


def interleaved_times(fns: dict, runs: int, warmup: bool = True) -> dict[str, list[float]]:
    if warmup:
        for fn in fns.values():
            fn()
    times = {name: [] for name in fns}
    for _ in range(runs):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def time_calls(fn, runs: int, warmup: int = 2) -> list[float]:
    """Seconds of ``runs`` calls of ``fn`` after ``warmup`` untimed ones."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return times


def bench_env() -> dict[str, str]:
    """This environment without the OpenBLAS overrides: numpy as its users run it."""
    return {k: v for k, v in os.environ.items() if k not in BLAS_VARS}


def install_tree(tree: str | Path, target: str | Path) -> str:
    """Build ``tree`` (a checkout of this repository) with its own build and install it into
    the folder ``target``; return ``target``, the folder to put first on a benchmark
    process's PYTHONPATH. The source folders run only as an installed package (setup.cfg
    maps rules/, executor/ and trainer/ into graphopt, setup.py places cli.py). No
    dependencies, no network: this environment has them."""
    done = subprocess.run([sys.executable, "-P", "-m", "pip", "install", "-q", "--no-deps",
                           "--no-build-isolation", "--no-input", "--target", str(target),
                           str(tree)], capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"cannot build and install {tree}:\n{done.stderr.strip()}")
    return str(target)


def blas_kernel() -> str:
    """Which BLAS numpy runs in this process, and its kernel (threadpoolctl)."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return "unknown (threadpoolctl is not installed)"
    import numpy  # noqa: F401  (loads the BLAS threadpoolctl looks for)

    found = [f"{i.get('internal_api')} {i.get('version')}, {i.get('architecture')} kernel, "
             f"{i.get('num_threads')} threads"
             for i in threadpool_info() if i.get("user_api") == "blas"]
    return "; ".join(found) or "none found"


def in_processes(script: str, workers: dict[str, list[str]], runs: int, rounds: int = 3,
                 timeout: float = 900) -> dict[str, dict]:
    """Run each worker (``script --worker ARGS --runs K``) in fresh processes, one at a time,
    the workers taking turns over ``rounds`` rounds (K = runs / rounds, rounded up), so that
    load from elsewhere hits all of them alike. A worker prints one JSON line with "times"
    (seconds) and anything else it measured; the times of its rounds are pooled."""
    per_round = -(-runs // rounds)
    results: dict[str, dict] = {name: {"times": []} for name in workers}
    for _ in range(rounds):
        for name, args in workers.items():
            proc = subprocess.run([sys.executable, script, "--worker", *args,
                                   "--runs", str(per_round)], env=bench_env(),
                                  capture_output=True, text=True, timeout=timeout)
            if proc.returncode != 0:
                raise SystemExit(f"benchmark worker {name} failed:\n{proc.stderr.strip()}")
            report = json.loads(proc.stdout.strip().splitlines()[-1])
            times = report.pop("times")
            merged = results[name]
            merged["times"].extend(times)
            for key, value in report.items():
                merged.setdefault(key, []).append(value)
    return results


def worker_report(times: list[float], **extra) -> None:
    """What a worker prints: its times, the BLAS kernel it ran, anything else."""
    print(json.dumps({"times": times, "blas": blas_kernel(), **extra}))


def med_min(times: list[float], scale: float = 1e3) -> tuple[float, float]:
    return statistics.median(times) * scale, min(times) * scale


def peak_rss_mb() -> float:
    """This process's peak resident set so far (MiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def command_line(script: str, argv: list[str] | None) -> str:
    """The exact command to rerun this benchmark as the method asks."""
    args = list(argv if argv is not None else sys.argv[1:])
    # where a run keeps its files or finds an interpreter changes no figure, and names a
    # folder of one machine: the command leaves those options out
    args = _without_options(args, LOCATION_OPTIONS)
    unset = " ".join(f"-u {v}" for v in BLAS_VARS)
    # thread limits change the figures: a run made with one says so
    limits = [f"{v}={os.environ[v]}" for v in THREAD_VARS if v in os.environ]
    return " ".join(["env", unset, *limits, "python", f"bench/{script}", *args]).strip()


LOCATION_OPTIONS = ("--cache", "--graphopt-python")


def _without_options(args: list[str], options: tuple[str, ...]) -> list[str]:
    kept, skip = [], False
    for arg in args:
        if skip:
            skip = False
        elif arg in options:
            skip = True
        elif not any(arg.startswith(option + "=") for option in options):
            kept.append(arg)
    return kept


def machine() -> str:
    return f"{platform.machine()}, {CORES} cores, Python {platform.python_version()}"


def settle(limit_s: float = 240.0, poll_s: float = 5.0) -> float:
    """The 1-minute load average once it is at most 1 per core, waited for up to ``limit_s``:
    a benchmark whose runs keep every core busy starts each run once its previous run has
    decayed out of the average, so that what a run's start records is load from elsewhere.
    Returns the load at the start (above 1 per core if it never settled)."""
    deadline = time.monotonic() + limit_s
    load = os.getloadavg()[0]
    while load > CORES and time.monotonic() < deadline:
        time.sleep(poll_s)
        load = os.getloadavg()[0]
    return load


def method_lines(load_after: float | None = None,
                 start_loads: list[float] | None = None) -> list[str]:
    after = os.getloadavg()[0] if load_after is None else load_after
    starts = (f", at most {max(start_loads):.2f} at a timed process's start"
              if start_loads else "")
    return [f"Load average (1 min): {LOAD_BEFORE:.2f} before, {after:.2f} after{starts} "
            f"({CORES} cores); BLAS: {blas_kernel()}."]


def publish_refusal(load_after: float, start_loads: list[float] | None = None) -> str | None:
    """Why a figure taken now must not be written to RESULTS.md, or None. With
    ``start_loads`` (each timed process's start, see ``settle``) those count instead of the
    load after the last run, which the benchmark's own processes make."""
    overrides = [v for v in BLAS_VARS if v in os.environ]
    if overrides:
        return (f"{' and '.join(overrides)} set in this process: run it as "
                f"`env -u {' -u '.join(BLAS_VARS)} python bench/...`")
    if start_loads:
        worst = max(LOAD_BEFORE, *start_loads)
        if worst > CORES:
            return (f"load average up to {worst:.2f} when a timed process started is above 1 "
                    f"per core ({CORES} cores): the figures are noise from other processes")
        return None
    worst = max(LOAD_BEFORE, load_after)
    if worst > CORES:
        return (f"load average {LOAD_BEFORE:.2f} before, {load_after:.2f} after is above 1 per "
                f"core ({CORES} cores): the figures are noise from other processes")
    return None


def write_section(title: str, body: str, path: Path = RESULTS,
                  start_loads: list[float] | None = None) -> None:
    """Replace (or append) one '## title' section of RESULTS.md, leaving the others alone;
    the load average and the BLAS kernel are appended. Refused (exit status 3, nothing
    written) when the load is above 1 per core or the OpenBLAS overrides are set."""
    load_after = os.getloadavg()[0]
    body = body.rstrip() + "\n" + "\n".join(method_lines(load_after, start_loads))
    refusal = publish_refusal(load_after, start_loads)
    if refusal:
        print(f"\nnot written to {path.name}: {refusal}", file=sys.stderr)
        raise SystemExit(3)
    heading = f"## {title}"
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    section = f"{heading}\n\n{body.rstrip()}\n"
    pattern = re.compile(rf"^{re.escape(heading)}\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _: section + "\n", text, count=1).rstrip() + "\n"
    else:
        text = text.rstrip() + "\n\n" + section
    path.write_text(text)
    print(f"\nwritten to {path}")


def publish(title: str, lines: list[str], write: bool,
            start_loads: list[float] | None = None) -> None:
    """Print a benchmark's report and, when ``write`` (no ``--no-write``), put it in RESULTS.md
    as the '## title' section (see ``write_section`` for when that is refused)."""
    body = "\n".join(lines)
    print(body)
    print("\n".join(method_lines(start_loads=start_loads)))
    if write:
        write_section(title, body, start_loads=start_loads)

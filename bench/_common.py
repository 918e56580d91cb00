"""What every benchmark here shares: interleaved timing and its section of RESULTS.md."""
from __future__ import annotations

import platform
import re
import statistics
import time
from pathlib import Path

RESULTS = Path(__file__).with_name("RESULTS.md")


def interleaved_medians(fns: dict, runs: int, warmup: bool = True) -> dict:
    """Median seconds per contender; contenders take turns within each round so that load
    from other processes on a shared machine hits all of them alike."""
    if warmup:
        for fn in fns.values():
            fn()
    times = {name: [] for name in fns}
    for _ in range(runs):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) for name, t in times.items()}


def machine() -> str:
    import os

    return f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"


def write_section(title: str, body: str, path: Path = RESULTS) -> None:
    """Replace (or append) one '## title' section of RESULTS.md, leaving the others alone."""
    heading = f"## {title}"
    text = path.read_text() if path.exists() else "# Benchmark results\n"
    section = f"{heading}\n\n{body.rstrip()}\n"
    pattern = re.compile(rf"^{re.escape(heading)}\n.*?(?=^## |\Z)", re.S | re.M)
    if pattern.search(text):
        text = pattern.sub(lambda _: section + "\n", text, count=1).rstrip() + "\n"
    else:
        text = text.rstrip() + "\n\n" + section
    path.write_text(text)


def publish(title: str, lines: list[str], write: bool) -> None:
    """Print a benchmark's report and, when ``write`` (no ``--no-write``), put it in RESULTS.md
    as the '## title' section."""
    body = "\n".join(lines)
    print(body)
    if write:
        write_section(title, body)

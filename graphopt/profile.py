"""Where an optimize spends its time and memory, phase by phase (``graphopt optimize
--profile``): load, the rewrites (each rule and pass, from the report), whole-model type
inference, validation, save.

Each phase's peak is the process's peak resident memory while it ran; its reads are the bytes
the process read from files meanwhile (``rchar`` of /proc/self/io, where there is one: what
shows that a phase never read the weights). On Linux the kernel's
high-water mark (VmHWM) is reset when a phase starts (writing 5 to /proc/self/clear_refs),
so a phase's peak is its own; elsewhere it is the process's peak so far (never lower than
the phase's, possibly higher)."""
from __future__ import annotations

import contextlib
import resource
import sys
import time
from dataclasses import dataclass, field


@dataclass
class Phase:
    name: str
    seconds: float = 0.0
    peak_bytes: int | None = None
    read_bytes: int | None = None


@dataclass
class Profile:
    phases: list[Phase] = field(default_factory=list)

    @contextlib.contextmanager
    def phase(self, name: str):
        entry = Phase(name)
        self.phases.append(entry)
        own_peak = _reset_peak()
        read_before = _bytes_read()
        start = time.perf_counter()
        try:
            yield entry
        finally:
            entry.seconds += time.perf_counter() - start
            entry.peak_bytes = _peak_bytes(own_peak)
            read_after = _bytes_read()
            if read_before is not None and read_after is not None:
                entry.read_bytes = read_after - read_before

    def add(self, name: str, seconds: float) -> None:
        """A phase timed by someone else (a rule, inference): its time, no peak of its own."""
        self.phases.append(Phase(name, seconds))

    def format(self) -> str:
        def mb(value):
            return "-" if value is None else f"{value / 2**20:,.0f}"

        rows = [(p.name, f"{p.seconds * 1e3:,.1f}", mb(p.peak_bytes), mb(p.read_bytes))
                for p in self.phases]
        width = max([len("phase"), *(len(r[0]) for r in rows)])
        lines = [f"{'phase':<{width}}  {'ms':>10}  {'peak RSS MB':>11}  {'read MB':>8}",
                 f"{'-' * width}  {'-' * 10}  {'-' * 11}  {'-' * 8}"]
        lines += [f"{name:<{width}}  {ms:>10}  {peak:>11}  {read:>8}"
                  for name, ms, peak, read in rows]
        return "\n".join(lines)


def _reset_peak() -> bool:
    """Reset the kernel's peak-RSS mark for this process; True where that worked."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def _bytes_read() -> int | None:
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("rchar:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


def _peak_bytes(own: bool) -> int | None:
    if own:
        try:
            with open("/proc/self/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) * 1024
        except (OSError, ValueError, IndexError):
            pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak * (1 if sys.platform == "darwin" else 1024)

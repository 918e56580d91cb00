"""Keep the host memory a NumPy run frees for the next run (issue 15).

glibc's malloc serves a block above its mmap threshold with a fresh ``mmap`` and unmaps it on
``free``, and gives the free memory at the top of its heap back to the kernel once it exceeds
the trim threshold. Both thresholds start at 128 KiB and only grow as large blocks are freed,
and an executor run allocates and frees the same tensors at every step: so every step faults
each page of its intermediates back in. Measured on the 2-core test machine, the
`--example mqa` training step (batch 32) took 1,632 page faults and 25.5 ms a step; with the
memory kept, none and 18.7 ms (the wider model: 2,984 faults, 141 -> 119 ms).

So, once a NumPy session knows how much memory its run needs, it asks glibc (``mallopt``) to
serve blocks up to 32 MiB (glibc's largest mmap threshold) from its heap, and to keep up to
the run's planned peak of freed memory instead of returning it. The settings are process-wide
and only ever raised: the process keeps, after a run, about the memory the run used at its
peak, which the next run needs again (RSS stays where the run took it, as it does with
PyTorch's CPU allocator). Nothing changes where it would override a choice already made:
``GRAPHOPT_KEEP_HOST_MEMORY=0``, or glibc's own ``MALLOC_MMAP_THRESHOLD_``,
``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_TOP_PAD_`` or ``GLIBC_TUNABLES`` malloc settings in the
environment. Other C libraries (musl, macOS) are left alone.
"""

from __future__ import annotations

import ctypes
import os
import platform

ENV = "GRAPHOPT_KEEP_HOST_MEMORY"
MMAP_THRESHOLD = 32 << 20  # glibc refuses a larger M_MMAP_THRESHOLD on 64-bit hosts
MIN_KEEP = 64 << 20  # what is kept when a run's peak is not known
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # <malloc.h>
_USER_SETTINGS = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_")


class _Malloc:
    """This process's glibc malloc, as far as keep_freed has set it."""

    def __init__(self):
        self.mallopt = None  # libc's mallopt once looked up; False: not to be used
        self.kept = 0  # the trim threshold set so far

    def keep(self, peak_bytes: int | None) -> bool:
        if self.mallopt is None:
            self.mallopt = _find_mallopt() or False
        if not self.mallopt:
            return False
        wanted = min(max(peak_bytes or 0, MIN_KEEP), (1 << 31) - 1)  # mallopt takes an int
        if wanted <= self.kept:
            return True
        if not self.kept and not self.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD):
            self.mallopt = False
            return False
        if self.mallopt(_M_TRIM_THRESHOLD, wanted):
            self.kept = wanted
        return bool(self.kept)


_malloc = _Malloc()


def kept_bytes() -> int:
    """The freed memory this process keeps (0: glibc's own settings)."""
    return _malloc.kept


def _find_mallopt():
    if os.environ.get(ENV, "1").strip().lower() in ("0", "off", "false", "no"):
        return None
    if any(os.environ.get(name) for name in _USER_SETTINGS):
        return None
    if "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return None
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return None
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return None
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return mallopt


def keep_freed(peak_bytes: int | None) -> bool:
    """Keep up to ``peak_bytes`` (None: MIN_KEEP) of freed host memory in this process for
    the next run. True when glibc's settings are (now) in place."""
    return _malloc.keep(peak_bytes)

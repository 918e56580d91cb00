"""Keep the host memory a NumPy run frees for the next run.

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

Blocks of 32 MiB and more glibc maps afresh whatever its settings: each run pays page faults
(and the kernel's zeroing) for every one it makes. ``SpareBlocks`` keeps such arrays
themselves once a run no longer needs them, for a later step or run that makes an array of
as many elements of the same dtype (the attention scores of the MQA block: 32 MiB at batch
8, seq 256, 16 heads; 0.9 ms of its 4.4 ms product went to the fresh mapping).
``GRAPHOPT_KEEP_HOST_MEMORY=0`` turns this off too.
"""

from __future__ import annotations

import ctypes
import math
import os
import platform
import sys

import numpy as np

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


def keeps_memory() -> bool:
    """False when the environment says ``GRAPHOPT_KEEP_HOST_MEMORY=0`` (or off, false, no):
    then glibc keeps its own settings and sessions keep no spare arrays."""
    return os.environ.get(ENV, "1").strip().lower() not in ("0", "off", "false", "no")


def _find_mallopt():
    if not keeps_memory():
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


def give_back_freed() -> None:
    """Return the freed memory keep_freed kept to the system (glibc's default trim threshold,
    then malloc_trim): once no run follows, what was kept for the next one is only RSS."""
    malloc = _malloc
    if not malloc.mallopt or not malloc.kept:
        return
    malloc.mallopt(_M_TRIM_THRESHOLD, 128 << 10)
    malloc.kept = 0
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass


def keep_freed(peak_bytes: int | None) -> bool:
    """Keep up to ``peak_bytes`` (None: MIN_KEEP) of freed host memory in this process for
    the next run. True when glibc's settings are (now) in place."""
    return _malloc.keep(peak_bytes)


LARGE_BYTES = MMAP_THRESHOLD  # glibc maps a block this large afresh at every allocation


def unshared_owner(array, holders: int):
    """The ndarray owning ``array``'s memory (``array`` itself, or the base of a view of
    it) when nothing references either beyond the caller's ``holders`` references to
    ``array`` (and, for a view, the view's own reference to its base); else None. What a
    kernel may overwrite, and a session may keep: not a feed, an initializer, a fetched
    tensor, a value a hook kept, nor an array a live view still reads."""
    # the caller's holders, this argument and getrefcount's argument
    if type(array) is not np.ndarray or sys.getrefcount(array) != holders + 2:
        return None
    owner = array.base
    if owner is None:
        return array
    # numpy points a view's base at the array owning the memory; three references to that
    # owner: the view's base, the local ``owner`` and getrefcount's argument
    if type(owner) is np.ndarray and owner.base is None and sys.getrefcount(owner) == 3:
        return owner
    return None


class SpareBlocks:
    """Large host arrays (LARGE_BYTES and more) a NumPy session's runs no longer need, kept
    for a kernel that makes an array of as many elements of the same dtype (``take``), in
    this run or a later one. ``offer`` keeps an array only when nothing but the offering
    caller references it: a feed, an initializer, a fetched tensor, a value a hook kept or a
    live view of it is never handed out again. At the end of a run (``end_run``) what this
    run released stays, up to the run's planned peak; spares of earlier runs that no run
    took are dropped, so changing shapes do not pile up memory.

    What a spare held before is never read: a kernel that takes one overwrites every element
    (``out=``) and lays out its result as it would have in an array of its own."""

    __slots__ = ("_spares", "_bytes")

    def __init__(self):
        # (size, dtype) -> [(array, released in the running run)]
        self._spares: dict[tuple, list[tuple[np.ndarray, bool]]] = {}
        self._bytes = 0

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __bool__(self) -> bool:
        """Whether any spare is kept now."""
        return self._bytes > 0

    def take(self, shape: tuple[int, ...], dtype) -> np.ndarray | None:
        """A spare C-contiguous array of ``shape`` and ``dtype`` (the array owning its
        memory, or a view of it), or None: the caller then allocates as usual. Only arrays of
        LARGE_BYTES and more are ever kept."""
        shape = tuple(shape)
        kept = self._spares.get((math.prod(shape), np.dtype(dtype)))
        if not kept:
            return None
        array, _ = kept.pop()
        self._bytes -= array.nbytes
        # an owner kept in another shape (a product made flat, returned reshaped) is handed
        # out as a view of that shape
        return array if array.shape == shape else array.reshape(shape)

    def offer(self, array, room: int | None = None) -> None:
        """Keep ``array`` (or the array owning its memory, for a view of one) if it is large
        and the caller holds the only reference to it: the caller drops its own next.
        ``room``: the bytes the spares may hold now without taking the process above the
        run's planned peak (its peak less what is live; None: not known, no bound): a
        forward activation released in the backward pass is given back to the system, not
        kept beside the tensors still to come."""
        if type(array) is not np.ndarray or array.nbytes < LARGE_BYTES:
            return
        if room is not None and self._bytes + array.nbytes > room:
            self._drop_earlier_runs(self._bytes + array.nbytes - room)
            if self._bytes + array.nbytes > room:
                return
        owner = unshared_owner(array, 2)  # the caller's reference and this argument
        if owner is None or not (owner.flags.c_contiguous and owner.flags.writeable
                                 and owner.flags.owndata):
            return
        self._spares.setdefault((owner.size, owner.dtype), []).append((owner, True))
        self._bytes += owner.nbytes

    def _drop_earlier_runs(self, wanted: int) -> None:
        """Drop spares an earlier run released, until ``wanted`` bytes are freed or none is
        left: this run's own releases are the likelier to be asked for again."""
        for key in list(self._spares):
            kept = self._spares[key]
            while wanted > 0 and kept and not kept[0][1]:
                array, _ = kept.pop(0)
                self._bytes -= array.nbytes
                wanted -= array.nbytes
            if not kept:
                del self._spares[key]
            if wanted <= 0:
                return

    def clear(self) -> None:
        """Drop every spare."""
        self._spares, self._bytes = {}, 0

    def end_run(self, keep_bytes: int | None) -> None:
        """Keep what this run released, up to ``keep_bytes`` (None: MIN_KEEP); drop the rest
        and every spare of an earlier run that this run did not take."""
        budget = MIN_KEEP if keep_bytes is None else keep_bytes
        spares: dict[tuple, list[tuple[np.ndarray, bool]]] = {}
        total = 0
        for key, kept in self._spares.items():
            for array, fresh in kept:
                if fresh and total + array.nbytes <= budget:
                    spares.setdefault(key, []).append((array, False))
                    total += array.nbytes
        self._spares, self._bytes = spares, total

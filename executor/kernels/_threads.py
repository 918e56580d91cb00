"""Row-parallel loops for large NumPy kernels (issue 15).

NumPy releases the GIL inside ufunc loops and reductions, so the halves of a large array
can be processed on two cores at once; BLAS already threads the GEMMs, this does the same
for the passes between them (softmax, erf, large elementwise ops). Below THRESHOLD elements
a split costs more than it saves; NumPy-only (CuPy kernels are already parallel).
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

THRESHOLD = 1 << 18  # elements
_WORKERS = max(1, min(os.cpu_count() or 1, 8))
_pool: ThreadPoolExecutor | None = None


def workers() -> int:
    return _WORKERS


def parts_for(size: int, rows: int) -> int:
    """How many pieces to cut ``rows`` rows holding ``size`` elements into (1: do not)."""
    if _WORKERS == 1 or size < THRESHOLD or rows < 2:
        return 1
    return min(_WORKERS, rows, size // (THRESHOLD // 2))


def run_split(fn, rows: int, parts: int) -> None:
    """``fn(start, stop)`` over ``parts`` contiguous row ranges covering ``range(rows)``, one
    of them on the calling thread; exceptions propagate."""
    if parts <= 1:
        fn(0, rows)
        return
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=_WORKERS - 1, thread_name_prefix="graphopt")
    bounds = [rows * i // parts for i in range(parts + 1)]
    futures = [_pool.submit(fn, bounds[i], bounds[i + 1]) for i in range(1, parts)]
    try:
        fn(bounds[0], bounds[1])
    finally:
        for future in futures:
            future.result()

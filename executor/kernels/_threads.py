"""Row-parallel loops for large NumPy kernels.

NumPy releases the GIL inside ufunc loops and reductions, so the halves of a large array
can be processed on two cores at once; BLAS already threads the GEMMs, this does the same
for the passes between them (softmax, erf, large elementwise ops). Below THRESHOLD elements
a split costs more than it saves; NumPy-only (CuPy kernels are already parallel).
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np

THRESHOLD = 1 << 18  # elements
# elements in one block of a row kernel (softmax and its gradient, LayerNorm and its
# gradient), ~512 KiB of float32. The threads take blocks in turn, and every NumPy call of a
# block takes the GIL: with 64K-element blocks two threads waited on each other for it at
# every call (an 8.4M-element softmax on 2 cores: 28 ms median with 64K blocks, 21 ms with
# 128K, the same with up to 1M; one thread is as fast with any of them)
ROW_BLOCK = 1 << 17
PIECES_PER_PART = 4
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
    """``fn(start, stop)`` over contiguous row ranges covering ``range(rows)`` once each, on
    the calling thread and up to ``parts - 1`` pool threads; exceptions propagate.

    The rows are cut into PIECES_PER_PART pieces per part that the threads take in turn,
    and the caller never waits for a pool thread that has not started: on a machine whose
    other cores are busy the caller does every piece itself (as fast as no split) instead
    of waiting for a thread the scheduler has not run. Each row is processed by
    one call of ``fn`` whatever the cut, so results do not depend on it."""
    if parts <= 1:
        fn(0, rows)
        return
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=_WORKERS - 1, thread_name_prefix="graphopt")
    pieces = min(rows, parts * PIECES_PER_PART)
    bounds = [rows * i // pieces for i in range(pieces + 1)]
    taken = [0]
    failed = []
    lock = threading.Lock()
    # a cancelled task stays in the pool's queue until a thread pops it: it must not hold
    # ``fn`` (and the arrays fn refers to) after this returns, or they outlive their last
    # use (memory, and the donation check would see one reference too many)
    job = [fn]

    def work() -> None:
        while not failed:
            with lock:
                i = taken[0]
                taken[0] = i + 1
                piece = job[0]
            if i >= pieces or piece is None:
                return
            try:
                piece(bounds[i], bounds[i + 1])
            except BaseException:
                failed.append(True)  # the others stop taking pieces
                raise

    futures = [_pool.submit(work) for _ in range(parts - 1)]
    try:
        work()
    finally:
        for future in futures:
            if not future.cancel():  # started: it finishes the one piece it holds
                future.result()
        job[0] = None


def run_rows(xp, fn, rows: int, width: int) -> None:
    """``fn(start, stop)`` over ``range(rows)`` rows of ``width`` elements: on NumPy in blocks
    of about ROW_BLOCK elements, on several threads when large (run_blocks); on another array
    module (CuPy: its kernels are parallel already) in one call."""
    if xp is not np:
        fn(0, rows)
        return
    run_blocks(fn, rows, rows_per_block(width), rows * width)


def rows_per_block(width: int) -> int:
    """How many rows of ``width`` elements run_rows hands ``fn`` at a time on NumPy (the
    last block may hold fewer); a block starts at a multiple of it."""
    return max(1, ROW_BLOCK // max(width, 1))


def run_blocks(fn, count: int, block: int, size: int | None = None) -> None:
    """``fn(start, stop)`` over ``range(count)`` cut in blocks of ``block`` (so that a block's
    passes run in cache), the blocks shared out over threads as ``parts_for`` decides for
    ``size`` elements (default: ``count``). Every block is the same whatever the cut."""
    blocks = -(-count // block)

    def work(first, last):
        for b in range(first, last):
            fn(b * block, min((b + 1) * block, count))

    run_split(work, blocks, parts_for(count if size is None else size, blocks))

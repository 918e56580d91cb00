"""Scatter reductions that give NumPy's bits on every backend, and index bounds checks.

NumPy's ``ufunc.at`` applies duplicate indices one after the other, in the order of the
updates. CuPy cannot be asked for that: ``multiply.at`` is not implemented,
``maximum.at``/``minimum.at`` reject float16 and bool, ``add.at`` rejects int64 before
CuPy 14.1, and what it does support (``add.at``, ``cupyx.scatter_add``) uses atomics,
so float sums change from run to run.

The portable path applies the updates in *rounds*: round r applies, for every target
row, its r-th update (counted in update order). Within a round the targets are distinct,
so a plain gather / ufunc / fancy-assignment is exact and race-free, and every row sees
its updates in the same order as ``ufunc.at``: the result is bitwise NumPy's, on any
device, every run. Cost: one stable sort, one device->host read of the per-round counts,
then three small kernels per round; the number of rounds is the largest number of
updates aimed at one row (1 for a permutation, the token frequency for an embedding
gradient).

On NumPy the rounds also beat ``ufunc.at`` (about 12 ns per updated element) unless rows are
narrow and rounds many. There they need no fancy indexing at all: the target rows are
gathered once into an accumulator ordered by how many updates each receives (most first),
and the updates are laid out round after round in that order, so round r is one ufunc call
on the accumulator's first k_r rows and a contiguous block of updates (about 2 us; an
embedding gradient of 1024 tokens x 64 over 56 rows: 0.15 ms instead of 0.7 ms).
NumPy takes the rounds when they cost less than ``ufunc.at``; both give the same bits.
"""

from __future__ import annotations

import numpy as np

from ._compiled import loaded_kernels

REDUCTIONS = {"add": "add", "mul": "multiply", "max": "maximum", "min": "minimum"}
# what one round costs on NumPy, in elements ufunc.at would update in the same time
_AT_ELEMENTS_PER_ROUND = 200


def scatter_rows(ctx, out2d, rows, updates2d, reduction: str) -> None:
    """In place: for each i in order, ``out2d[rows[i]] = op(out2d[rows[i]], updates2d[i])``.

    ``out2d``: (R, C) C-contiguous; ``rows``: (n,) int64 in [0, R); ``updates2d``: (n, C).
    """
    xp = ctx.xp
    ufunc = getattr(xp, REDUCTIONS[reduction])
    n = int(rows.shape[0])
    width = updates2d.shape[1] if updates2d.ndim == 2 else 1
    if reduction == "add" and _compiled_add(xp, out2d, rows, updates2d):
        return
    if xp is np and not _rounds_may_pay(n, width, 2):
        ufunc.at(out2d, rows, updates2d)  # NumPy's own sequential loop: the reference order
        return
    if n == 0:
        return
    order = xp.argsort(rows, kind="stable")  # updates grouped by row, update order kept
    sorted_rows = rows[order]
    first = xp.ones(n, dtype=np.bool_)
    first[1:] = sorted_rows[1:] != sorted_rows[:-1]
    group = xp.cumsum(first) - 1
    group_start = xp.nonzero(first)[0]
    rank = xp.arange(n) - group_start[group]  # how many earlier updates hit the same row
    per_round = ctx.host_ints(xp.bincount(rank))
    if xp is np:
        if _rounds_may_pay(n, width, len(per_round)):
            _contiguous_rounds(out2d, updates2d, ufunc, order, sorted_rows, group_start,
                               group, rank, per_round)
        else:
            ufunc.at(out2d, rows, updates2d)  # many rounds of narrow rows: ufunc.at is cheaper
        return
    by_round = order[xp.argsort(rank, kind="stable")]
    start = 0
    for count in per_round:
        ids = by_round[start:start + count]
        start += count
        targets = rows[ids]
        out2d[targets] = ufunc(out2d[targets], updates2d[ids])


def _contiguous_rounds(out2d, updates2d, ufunc, order, sorted_rows, group_start, group,
                       rank, per_round) -> None:
    """The rounds on NumPy, each one ufunc call on contiguous rows (see the module's doc)."""
    n = order.shape[0]
    counts = np.diff(np.append(group_start, n))  # updates per target row
    by_count = np.argsort(-counts, kind="stable")  # most updated rows first
    slot = np.empty_like(by_count)
    slot[by_count] = np.arange(by_count.shape[0])  # a target's row in the accumulator
    # round r holds the per_round[r] targets updated more than r times: accumulator rows
    # 0..per_round[r]-1, each getting its r-th update
    round_start = np.zeros(len(per_round), dtype=np.int64)
    np.cumsum(per_round[:-1], out=round_start[1:])
    source = np.empty(n, dtype=np.int64)
    source[round_start[rank] + slot[group]] = order
    laid_out = np.take(updates2d, source, axis=0)
    targets = sorted_rows[group_start[by_count]]
    acc = np.take(out2d, targets, axis=0)
    start = 0
    for count in per_round:
        ufunc(acc[:count], laid_out[start:start + count], out=acc[:count])
        start += count
    out2d[targets] = acc


def _compiled_add(xp, out2d, rows, updates2d) -> bool:
    """float32 ``add`` in the compiled loop of ``np.add.at`` (the same bits, 5-10x faster than
    the rounds on an embedding gradient), when the arrays allow it and the compiled kernels
    are loaded (a session whose graph holds GatherGrad loads them); False: not done."""
    if (updates2d.ndim != 2 or out2d.ndim != 2 or out2d.dtype != np.float32
            or updates2d.dtype != np.float32 or rows.dtype != np.int64
            or not out2d.flags.c_contiguous or not updates2d.flags.c_contiguous
            or not out2d.flags.writeable):
        return False
    compiled = loaded_kernels(xp, out2d.dtype, updates2d.size)
    if compiled is None:
        return False
    bad = compiled.scatter_add_rows(out2d, rows, updates2d)
    if bad >= 0:  # as NumPy says it
        raise IndexError(f"index {int(rows[bad])} is out of bounds for axis 0 with size "
                         f"{out2d.shape[0]}")
    return True


def _rounds_may_pay(n: int, width: int, rounds: int) -> bool:
    """Whether ``rounds`` rounds cost NumPy less than ufunc.at on ``n`` rows of ``width``."""
    return rounds * _AT_ELEMENTS_PER_ROUND < n * width


def linear_index(xp, coordinates, shape) -> object:
    """Row-major flat index (int64) of a tuple of broadcastable coordinate arrays."""
    flat = None
    for coordinate, dim in zip(coordinates, shape, strict=True):
        term = coordinate.astype(np.int64)
        flat = term if flat is None else flat * dim + term
    return flat


def check_bounds(ctx, indices, dims, what: str) -> None:
    """Raise IndexError for an index outside [0, dim) (after negative-index fixing: an index
    below -dim is still negative then, and NumPy's take would wrap it a second time, as
    CuPy's take and fancy indexing wrap every out-of-range index). For one dimension, a min
    and a max over the indices, no temporaries (on a GPU, and their device->host read)."""
    xp = ctx.xp
    if indices.size == 0:
        return
    if isinstance(dims, list | tuple):
        limit = xp.asarray(dims, dtype=indices.dtype)
        out_of_range = bool(xp.any((indices < 0) | (indices >= limit)))
    else:
        out_of_range = int(indices.min()) < 0 or int(indices.max()) >= int(dims)
    if out_of_range:
        shown = tuple(dims) if isinstance(dims, list | tuple) else (int(dims),)
        raise IndexError(f"{what}: index out of range for dimension(s) {shown} (an index "
                         "must lie in [-dim, dim))")

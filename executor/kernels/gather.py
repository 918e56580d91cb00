"""Indexing: Gather, GatherElements, GatherND, ScatterND, ScatterElements, OneHot, TopK, ..."""

from __future__ import annotations

import math

import numpy as np

from ..memory import check_allocation
from ..registry import kernel
from ._scatter import check_bounds, linear_index, scatter_rows
from ._util import norm_axis


def _fix_negative(xp, indices, dim):
    return xp.where(indices < 0, indices + dim, indices)


@kernel("Gather")
def gather(ctx, node, data, indices):
    axis = norm_axis(node.attr("axis"), data.ndim)
    indices = _fix_negative(ctx.xp, indices, data.shape[axis])
    check_bounds(ctx, indices, data.shape[axis], "Gather")
    return ctx.xp.take(data, indices, axis=axis)


@kernel("GatherElements", since=11)
def gather_elements(ctx, node, data, indices):
    axis = norm_axis(node.attr("axis"), data.ndim)
    indices = _fix_negative(ctx.xp, indices, data.shape[axis])
    check_bounds(ctx, indices, data.shape[axis], "GatherElements")
    return ctx.xp.take_along_axis(data, indices, axis=axis)


@kernel("GatherND", since=11)
def gather_nd(ctx, node, data, indices):
    xp = ctx.xp
    b = node.attr("batch_dims")
    k = indices.shape[-1]
    indices = xp.where(indices < 0,
                       indices + xp.asarray(data.shape[b:b + k], dtype=indices.dtype), indices)
    check_bounds(ctx, indices, list(data.shape[b:b + k]), "GatherND")
    batch_shape = data.shape[:b]
    n_batch = math.prod(batch_shape)
    flat_data = data.reshape((n_batch,) + data.shape[b:])
    flat_idx = indices.reshape((n_batch, -1, k))
    out = []
    for i in range(n_batch):
        cols = tuple(flat_idx[i, :, j] for j in range(k))
        out.append(flat_data[i][cols])
    result = xp.stack(out)
    return result.reshape(indices.shape[:-1] + data.shape[b + k:])


@kernel("ScatterND", since=11)
def scatter_nd(ctx, node, data, indices, updates):
    xp = ctx.xp
    out = data.copy()
    k = indices.shape[-1]
    idx = indices.reshape(-1, k)
    upd = updates.reshape((idx.shape[0],) + data.shape[k:])
    reduction = node.attr("reduction")
    idx = xp.where(idx < 0, idx + xp.asarray(data.shape[:k], dtype=idx.dtype), idx)
    check_bounds(ctx, idx, list(data.shape[:k]), "ScatterND")
    cols = tuple(idx[:, j] for j in range(k))
    if reduction == "none":
        out[cols] = upd
    else:
        rows = linear_index(xp, cols, data.shape[:k])
        out2d = out.reshape(math.prod(data.shape[:k]), -1)
        scatter_rows(ctx, out2d, rows, upd.reshape(idx.shape[0], -1), reduction)
    return out


def _open_grid(xp, shape):
    """numpy.indices(shape, sparse=True), which CuPy does not have."""
    rank = len(shape)
    return [xp.arange(n).reshape([-1 if j == i else 1 for j in range(rank)])
            for i, n in enumerate(shape)]


@kernel("ScatterElements", since=11)
def scatter_elements(ctx, node, data, indices, updates):
    xp = ctx.xp
    axis = norm_axis(node.attr("axis"), data.ndim)
    indices = _fix_negative(xp, indices, data.shape[axis])
    check_bounds(ctx, indices, data.shape[axis], "ScatterElements")
    out = data.copy()
    grid = _open_grid(xp, indices.shape)
    grid[axis] = indices
    reduction = node.attr("reduction")
    if reduction == "none":
        out[tuple(grid)] = updates
    else:
        rows = linear_index(xp, [xp.broadcast_to(g, indices.shape) for g in grid], data.shape)
        scatter_rows(ctx, out.reshape(-1, 1), rows.reshape(-1), updates.reshape(-1, 1),
                     reduction)
    return out


@kernel("OneHot", since=9)
def one_hot(ctx, node, indices, depth, values):
    xp = ctx.xp
    depth = int(ctx.host_scalar(depth))
    axis = node.attr("axis")
    rank = indices.ndim + 1
    axis = norm_axis(axis, rank)
    shape = list(indices.shape)
    check_allocation(ctx, node, shape[:axis] + [depth] + shape[axis:], values.dtype)
    idx = indices.astype(np.int64)
    idx = xp.where(idx < 0, idx + depth, idx)
    hot = xp.expand_dims(idx, axis) == xp.arange(depth).reshape(
        [-1 if i == axis else 1 for i in range(rank)])
    return xp.where(hot, values[1], values[0]).astype(values.dtype)


@kernel("TopK", since=10)
def top_k(ctx, node, x, k):
    xp = ctx.xp
    k = int(ctx.host_scalar(k))
    axis = norm_axis(node.attr("axis"), x.ndim)
    largest = node.attr("largest")
    # stable sort on the key keeps the lower index first among equal values
    key = (~x if x.dtype.kind == "u" else -x) if largest else x
    order = xp.argsort(key, axis=axis, kind="stable")
    indices = xp.take(order, xp.arange(k), axis=axis)
    return xp.take_along_axis(x, indices, axis=axis), indices.astype(np.int64)


@kernel("NonZero", since=9)
def non_zero(ctx, node, x):
    check_allocation(ctx, node, [x.ndim, int(ctx.xp.count_nonzero(x))], np.int64)
    return ctx.xp.stack(ctx.xp.nonzero(x)).astype(np.int64).reshape(x.ndim, -1)

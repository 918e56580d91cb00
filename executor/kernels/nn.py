"""Normalisation and probability layers: Softmax family, LayerNorm, BatchNorm, Dropout."""

from __future__ import annotations

import math

import numpy as np

from ..registry import kernel
from ._compiled import compiled_kernels
from ._threads import run_rows
from ._util import (
    compute_dtype,
    max_over,
    norm_axis,
    row_dots,
    row_max,
    row_sums,
    summed_by_rows,
    sums_over,
)


def softmax_over(xp, x, axes, out=None):
    """Softmax of x over ``axes`` in x's compute dtype; ``out``, when given, is an array of
    x's shape and dtype that may be x itself (the result has x's layout either way).
    Trailing softmax axes (the usual case) are done as rows in x's own memory layout
    (attention scores are often a transposed view):
    on NumPy row block by row block, on several threads when large; the same operations in
    one go on a GPU (so both give the same numbers)."""
    ct = compute_dtype(x.dtype)
    data = x if ct == x.dtype else x.astype(ct)
    if ct != x.dtype:
        out = None
    if data.size and _trailing(axes, data.ndim):
        rows = as_rows(data, axes)
        if rows is None:  # not dense in any axis order (a slice with steps): one copy
            data = xp.ascontiguousarray(data)
            rows = as_rows(data, axes)
        result = _softmax_rows(xp, data, rows, out)
    else:
        if out is None:
            out = xp.empty_like(data)
        _softmax_into(xp, data, axes, out)
        result = out
    return result if ct == x.dtype else result.astype(x.dtype)


def _trailing(axes, ndim) -> bool:
    return tuple(axes) == tuple(range(ndim - len(axes), ndim))


def as_rows(x, axes):
    """(order, x2d): x's axes in memory order (the softmax axes, trailing, last) and x as a
    2-D view of (rows, softmax elements), or None when x's memory is not dense in some axis
    order with the softmax axes innermost."""
    last = tuple(range(x.ndim - len(axes), x.ndim))
    outer = sorted(range(x.ndim - len(axes)), key=lambda a: -x.strides[a])
    order = outer + list(last)
    dense = x.transpose(order)
    if not dense.flags.c_contiguous:
        return None
    return order, dense.reshape(-1, math.prod(x.shape[a] for a in last))


def empty_in_order(xp, shape, order, dtype):
    """An empty array of ``shape`` whose memory runs through its axes in ``order`` (as_rows'
    order: the result of a row kernel laid out as its input)."""
    return xp.empty([shape[a] for a in order], dtype).transpose(
        [order.index(a) for a in range(len(shape))])


def _softmax_rows(xp, x, rows, out):
    order, x2 = rows
    if out is None or out.strides != x.strides:
        out = result = empty_in_order(xp, x.shape, order, x.dtype)
    else:  # x itself (donated), or a buffer of x's layout
        result = out
    o2 = out.reshape(x2.shape) if out.ndim == 2 else out.transpose(order).reshape(x2.shape)
    count, width = x2.shape
    compiled = compiled_kernels(xp, x.dtype, x2.size)

    def rows_of(lo, hi):
        src, dst = x2[lo:hi], o2[lo:hi]
        if compiled is not None:  # one pass a row, its exp vectorised
            compiled.softmax_rows(src, dst)
            return
        xp.subtract(src, row_max(xp, src)[:, None], out=dst)
        xp.exp(dst, out=dst)
        total = row_sums(xp, dst)
        xp.reciprocal(total, out=total)
        dst *= total[:, None]

    run_rows(xp, rows_of, count, width)
    return result


def _softmax_into(xp, x, axes, out):
    peak = max_over(xp, x, axes)
    xp.subtract(x, peak, out=out)
    xp.exp(out, out=out)
    out /= out.sum(axis=axes, keepdims=True)


def log_softmax_over(xp, x, axes):
    ct = compute_dtype(x.dtype)
    data = x if ct == x.dtype else x.astype(ct)
    compiled = compiled_kernels(xp, ct, data.size) if len(axes) == 1 else None
    if compiled is not None:
        out = _compiled_log_softmax(xp, compiled, data, axes[0])
        if out is not None:
            return out if ct == x.dtype else out.astype(x.dtype)
    out = data - max_over(xp, data, axes)
    out -= xp.log(sums_over(xp, exp_of_nonpositive(xp, out), axes))
    return out if ct == x.dtype else out.astype(x.dtype)


def _compiled_log_softmax(xp, compiled, data, axis):
    """log_softmax of ``data`` over ``axis`` in one pass a row, laid out as the NumPy passes
    lay it out (as ``data``), or None for a layout the kernels do not take. Classes
    innermost in memory (a transposed view of a language model's logits, a last axis): row
    by row, in row blocks over threads when large; classes on a middle axis of a
    C-contiguous array: along the positions."""
    classes_last = xp.moveaxis(data, axis, -1)
    rows = as_rows(classes_last, (data.ndim - 1,))
    if rows is not None:
        order, x2 = rows
        out = empty_in_order(xp, classes_last.shape, order, data.dtype)
        o2 = out.transpose(order).reshape(x2.shape)
        run_rows(xp, lambda lo, hi: compiled.log_softmax_rows(x2[lo:hi], o2[lo:hi]),
                 *x2.shape)
        return xp.moveaxis(out, -1, axis)
    if 0 < axis < data.ndim - 1 and data.flags.c_contiguous:
        shape3 = (math.prod(data.shape[:axis]), data.shape[axis], -1)
        out = xp.empty_like(data)
        compiled.log_softmax_classes(data.reshape(shape3), out.reshape(shape3))
        return out
    return None


def exp_of_nonpositive(xp, x, out=None):
    """``xp.exp(x, out=out)`` for x that is at most 0 by construction (scores less their
    maximum, log-probabilities): the compiled kernel's vectorised exp for NumPy float32 (it
    checks the sign and leaves any other x to NumPy's exp). ``out`` has x's layout; so does
    the result."""
    compiled = compiled_kernels(xp, x.dtype, x.size)
    order = memory_order(x) if compiled is not None else None
    if order is not None:  # x dense in memory, in some order of its axes
        result = xp.empty_like(x) if out is None else out  # empty_like: x's layout
        flat = result.transpose(order)
        if flat.flags.c_contiguous and compiled.exp_of_nonpositive(
                x.transpose(order).reshape(-1), flat.reshape(-1)):
            return result
    return xp.exp(x, out=out)


def memory_order(x):
    """x's axes from the largest stride to the smallest when x's memory is dense in that
    order (``x.transpose(order)`` is C-contiguous: a transposed view, say), else None."""
    order = sorted(range(x.ndim), key=lambda a: -x.strides[a])
    return order if x.transpose(order).flags.c_contiguous else None


def _hardmax_over(xp, x, axes):
    # axes are contiguous and trailing-or-single: flatten them into one, first max wins
    first, last = axes[0], axes[-1]
    shape = x.shape[:first] + (-1,) + x.shape[last + 1:]
    flat = x.reshape(shape)
    winner = xp.expand_dims(xp.argmax(flat, axis=first), first)
    out = xp.zeros_like(flat)
    xp.put_along_axis(out, winner, 1, axis=first)
    return out.reshape(x.shape)


def coerced_axes(node, x, default_axis):
    """Pre-13 semantics: the input is coerced to 2-D at ``axis``; reduce over axis..rank-1."""
    axis = norm_axis(node.attrs.get("axis", default_axis), x.ndim)
    return tuple(range(axis, x.ndim))


def single_axis(node, x):
    return (norm_axis(node.attrs.get("axis", -1), x.ndim),)


def _donated_x(ctx, x):
    return ctx.out_for(x.shape, x.dtype, x, any_layout=True)  # softmax keeps x's layout


@kernel("Softmax", until=12, inplace=True)
def softmax_coerced(ctx, node, x):
    return softmax_over(ctx.xp, x, coerced_axes(node, x, 1), _donated_x(ctx, x))


@kernel("Softmax", since=13, inplace=True)
def softmax(ctx, node, x):
    return softmax_over(ctx.xp, x, single_axis(node, x), _donated_x(ctx, x))


for _op, _fn in (("LogSoftmax", log_softmax_over), ("Hardmax", _hardmax_over)):
    kernel(_op, until=12)(lambda ctx, node, x, _fn=_fn: _fn(ctx.xp, x, coerced_axes(node, x, 1)))
    kernel(_op, since=13)(lambda ctx, node, x, _fn=_fn: _fn(ctx.xp, x, single_axis(node, x)))


_NO_BIAS = np.empty(0, np.float32)


def _layer_norm_rows(xp, x, axis, epsilon, stash_dtype, scale, bias=None):
    """float32/float64 (every backend): (y, mean, inv_std) from the row statistics of the
    (rows, D) view summed by einsum, mean and inv_std in the keepdims shape; y is x centered,
    times inv_std, times the flat ``scale`` and plus the flat ``bias`` (when given), in
    stash_dtype. On NumPy row block by row block, on several threads when large (each row is
    computed the same way wherever the blocks are cut)."""
    rows = math.prod(x.shape[:axis])
    width = x.size // rows if rows else 0
    data = x.astype(stash_dtype, copy=False).reshape(rows, width)
    # in x's shape (a reshaped (rows, D) array would be a view: not donated on)
    result = xp.empty(x.shape, stash_dtype)
    y = result.reshape(rows, width)
    mean = xp.empty(rows, stash_dtype)
    inv_std = xp.empty(rows, stash_dtype)
    compiled = compiled_kernels(xp, stash_dtype, data.size)
    if compiled is not None:
        scale = np.ascontiguousarray(scale, stash_dtype)
        bias = _NO_BIAS if bias is None else np.ascontiguousarray(bias, stash_dtype)
        epsilon = stash_dtype.type(epsilon)

    def rows_of(lo, hi):
        block_mean, block_inv = mean[lo:hi], inv_std[lo:hi]
        if compiled is not None:  # one pass a row for the statistics, one for y
            compiled.layer_norm_rows(data[lo:hi], scale, bias, epsilon, y[lo:hi],
                                     block_mean, block_inv)
            return
        xp.divide(row_sums(xp, data[lo:hi]), width, out=block_mean)
        centered = xp.subtract(data[lo:hi], block_mean[:, None], out=y[lo:hi])
        var = row_dots(xp, centered, centered)
        var /= width
        var += epsilon
        xp.sqrt(var, out=var)
        xp.divide(1.0, var, out=block_inv)
        centered *= block_inv[:, None]
        centered *= scale
        if bias is not None:
            centered += bias

    run_rows(xp, rows_of, rows, width)
    stats_shape = x.shape[:axis] + (1,) * (x.ndim - axis)
    return result, mean.reshape(stats_shape), inv_std.reshape(stats_shape)


def layer_norm_stats(xp, x, axis, epsilon, stash_dtype):
    axes = tuple(range(axis, x.ndim))
    data = x.astype(stash_dtype, copy=False)
    mean = data.mean(axis=axes, keepdims=True)
    centered = data - mean
    var = (centered * centered).mean(axis=axes, keepdims=True)
    inv_std = 1.0 / xp.sqrt(var + epsilon)
    return centered, mean, inv_std


@kernel("LayerNormalization", since=17)
def layer_normalization(ctx, node, x, scale, bias=None):
    xp = ctx.xp
    axis = norm_axis(node.attr("axis"), x.ndim)
    epsilon = node.attrs.get("epsilon", 1e-5)
    stash = np.dtype(np.float32) if node.attr("stash_type") == 1 else x.dtype
    stash = np.promote_types(stash, compute_dtype(x.dtype))
    if summed_by_rows(stash) and x.size and 0 < axis and per_row_params(x, axis, scale, bias):
        y, mean, inv_std = _layer_norm_rows(
            xp, x, axis, epsilon, stash, scale.reshape(-1),
            None if bias is None else bias.reshape(-1))
        return y.astype(x.dtype, copy=False), mean, inv_std
    centered, mean, inv_std = layer_norm_stats(xp, x, axis, epsilon, stash)
    y = centered  # a temporary of layer_norm_stats: scaled in place, same order
    y *= inv_std
    y *= scale
    if bias is not None:
        y += bias
    return y.astype(x.dtype, copy=False), mean, inv_std


def per_row_params(x, axis, *params):
    """Whether every parameter (scale, bias; None for absent) has one value per element of a
    normalized row: the (rows, D) fast paths need them flat."""
    width = math.prod(x.shape[axis:])
    return all(p is None or (p.size == width and p.shape == x.shape[x.ndim - p.ndim:])
               for p in params)


@kernel("BatchNormalization", since=9)
def batch_normalization(ctx, node, x, scale, bias, mean, var):
    xp = ctx.xp
    epsilon = node.attrs.get("epsilon", 1e-5)
    channel_shape = (1, -1) + (1,) * (x.ndim - 2)
    training = node.opset >= 14 and node.attr("training_mode") == 1
    if training:
        axes = (0,) + tuple(range(2, x.ndim))
        batch_mean = x.mean(axis=axes)
        batch_var = x.var(axis=axes)
        momentum = node.attrs.get("momentum", 0.9)
        use_mean, use_var = batch_mean, batch_var
    else:
        use_mean, use_var = mean, var
    inv = (scale / xp.sqrt(use_var + epsilon)).reshape(channel_shape)
    y = (x - use_mean.reshape(channel_shape)) * inv + bias.reshape(channel_shape)
    y = y.astype(x.dtype, copy=False)
    if not training:
        return y
    running_mean = (mean * momentum + batch_mean * (1 - momentum)).astype(mean.dtype)
    running_var = (var * momentum + batch_var * (1 - momentum)).astype(var.dtype)
    return y, running_mean, running_var


@kernel("InstanceNormalization", since=6)
def instance_normalization(ctx, node, x, scale, bias):
    xp = ctx.xp
    axes = tuple(range(2, x.ndim))
    mean = x.mean(axis=axes, keepdims=True)
    var = x.var(axis=axes, keepdims=True)
    shape = (1, -1) + (1,) * (x.ndim - 2)
    y = (x - mean) / xp.sqrt(var + node.attrs.get("epsilon", 1e-5))
    return (y * scale.reshape(shape) + bias.reshape(shape)).astype(x.dtype, copy=False)


def dropout(ctx, node, x, ratio: float, training: bool):
    xp = ctx.xp
    if not training or ratio == 0.0:
        return x, xp.ones(x.shape, dtype=bool)
    mask = ctx.uniform(x.shape, node.name, node.attrs.get("seed")) >= ratio
    scale = 1.0 / (1.0 - ratio)
    return (x * mask * scale).astype(x.dtype, copy=False), mask


@kernel("Dropout", since=7, until=11)
def dropout_attr(ctx, node, x):
    return dropout(ctx, node, x, node.attr("ratio"), ctx.training)


@kernel("Dropout", since=12)
def dropout_inputs(ctx, node, x, ratio=None, training_mode=None):
    ratio = 0.5 if ratio is None else float(ctx.host_scalar(ratio))
    training = ctx.training if training_mode is None else bool(ctx.host_scalar(training_mode))
    return dropout(ctx, node, x, ratio, training)

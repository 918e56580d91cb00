"""Reductions (axes as attribute before opset 13/18, as input after) and ArgMax/ArgMin."""

from __future__ import annotations

import math

import numpy as np

from ..registry import kernel
from ._util import column_sums, compute_dtype, norm_axis, row_sums, summed_by_rows


def reduce_axes(ctx, node, x, axes_input):
    """A Reduce node's axes: its axes input (or attribute) normalised, or all of them, or
    None for noop_with_empty_axes (the identity)."""
    if axes_input is None or axes_input.size == 0:
        if node.attr("noop_with_empty_axes"):
            return None  # identity
        return tuple(range(x.ndim))
    return tuple(norm_axis(a, x.ndim) for a in ctx.host_ints(axes_input))


def _attr_axes(node, x):
    axes = node.attrs.get("axes")
    if axes is None or len(axes) == 0:
        return tuple(range(x.ndim))
    return tuple(norm_axis(a, x.ndim) for a in axes)


def _lowest(dtype):
    """Identity of max, for empty reductions (ONNX wants -inf / the lowest value)."""
    if dtype == np.bool_:
        return False
    return -np.inf if dtype.kind == "f" else np.iinfo(dtype).min


def _highest(dtype):
    if dtype == np.bool_:
        return True
    return np.inf if dtype.kind == "f" else np.iinfo(dtype).max


def _extreme(name, identity):
    """xp.max / xp.min with ONNX's identity for an empty input. Not through ``initial=``:
    CuPy's amax/amin have no such parameter."""

    def run(xp, x, axes, keepdims):
        if x.size == 0:
            shape = tuple(1 if i in axes else n for i, n in enumerate(x.shape) if keepdims
                          or i not in axes)
            return xp.full(shape, identity(x.dtype), dtype=x.dtype)
        return getattr(xp, name)(x, axis=axes, keepdims=keepdims)

    return run


_reduce_max = _extreme("max", _lowest)
_reduce_min = _extreme("min", _highest)


def reduce_sum(xp, x, axes, keepdims):
    axes = tuple(sorted(axes))
    if (summed_by_rows(x.dtype) and x.size and len(axes) < x.ndim
            and axes == tuple(range(axes[0], axes[0] + len(axes)))
            and (axes[0] == 0 or axes[-1] == x.ndim - 1)):
        # leading or trailing axes (a bias gradient, a row sum): einsum on the
        # 2-D view, not NumPy's reduction (per-row overhead for short rows)
        kept = [n for i, n in enumerate(x.shape) if i not in axes]
        if axes[0] == 0:
            sums = column_sums(xp, x.reshape(-1, math.prod(kept)))
        else:
            sums = row_sums(xp, x.reshape(math.prod(kept), -1))
        shape = [1 if i in axes else n for i, n in enumerate(x.shape)] if keepdims else kept
        return sums.reshape(shape)
    return xp.sum(x, axis=axes, keepdims=keepdims, dtype=x.dtype)


def _float_reduce(fn):
    def run(xp, x, axes, keepdims):
        ct = compute_dtype(x.dtype)
        data = x if ct == x.dtype else x.astype(ct)
        return fn(xp, data, axes, keepdims).astype(x.dtype, copy=False)

    return run


_REDUCERS = {
    "ReduceSum": (reduce_sum, 13),
    "ReduceMean": (_float_reduce(lambda xp, x, a, k: xp.mean(x, axis=a, keepdims=k)), 18),
    "ReduceMax": (_reduce_max, 18),
    "ReduceMin": (_reduce_min, 18),
    "ReduceProd": (lambda xp, x, a, k: xp.prod(x, axis=a, keepdims=k, dtype=x.dtype), 18),
    "ReduceL1": (lambda xp, x, a, k: xp.sum(xp.abs(x), axis=a, keepdims=k, dtype=x.dtype), 18),
    "ReduceL2": (
        _float_reduce(lambda xp, x, a, k: xp.sqrt(xp.sum(x * x, axis=a, keepdims=k))), 18),
    "ReduceSumSquare": (lambda xp, x, a, k: xp.sum(x * x, axis=a, keepdims=k, dtype=x.dtype), 18),
    "ReduceLogSum": (_float_reduce(lambda xp, x, a, k: xp.log(xp.sum(x, axis=a, keepdims=k))), 18),
    "ReduceLogSumExp": (_float_reduce(
        lambda xp, x, a, k: _logsumexp(xp, x, a, k)), 18),
}


def _logsumexp(xp, x, axes, keepdims):
    peak = _reduce_max(xp, x, axes, True)
    peak = xp.where(xp.isfinite(peak), peak, 0)
    result = xp.log(xp.sum(xp.exp(x - peak), axis=axes, keepdims=True)) + peak
    return result if keepdims else xp.squeeze(result, axis=axes)


def _empty_reduce(xp, fn, x, axes, keepdims):
    if axes is None:
        return x.copy()
    return fn(xp, x, axes, bool(keepdims))


def _attr_kernel(fn):
    def run(ctx, node, x):
        return _empty_reduce(ctx.xp, fn, x, _attr_axes(node, x), node.attr("keepdims"))

    return run


def _input_kernel(fn):
    def run(ctx, node, x, axes=None):
        return _empty_reduce(ctx.xp, fn, x, reduce_axes(ctx, node, x, axes),
                             node.attr("keepdims"))

    return run


for _name, (_fn, _switch) in _REDUCERS.items():
    kernel(_name, until=_switch - 1)(_attr_kernel(_fn))
    kernel(_name, since=_switch)(_input_kernel(_fn))


def _arg(fn_name):
    def run(ctx, node, x):
        xp = ctx.xp
        axis = norm_axis(node.attr("axis"), x.ndim)
        keepdims = node.attr("keepdims")
        fn = getattr(xp, fn_name)
        if node.attr("select_last_index"):
            flipped = xp.flip(x, axis=axis)
            result = x.shape[axis] - 1 - fn(flipped, axis=axis)
        else:
            result = fn(x, axis=axis)
        result = result.astype(np.int64)
        return xp.expand_dims(result, axis) if keepdims else result

    return run


kernel("ArgMax")(_arg("argmax"))
kernel("ArgMin")(_arg("argmin"))


@kernel("CumSum", since=11)
def cumsum(ctx, node, x, axis):
    """Inclusive or exclusive running sum, forwards or in reverse (Bloom's ALiBi positions)."""
    xp = ctx.xp
    axis = norm_axis(ctx.host_scalar(axis), x.ndim)
    reverse = node.attr("reverse")
    if reverse:
        x = xp.flip(x, axis)
    out = xp.cumsum(x, axis=axis, dtype=x.dtype)
    if node.attr("exclusive"):  # shifted by one along the axis, zero first
        shifted = xp.zeros_like(out)
        into = [slice(None)] * x.ndim
        into[axis] = slice(1, None)
        source = [slice(None)] * x.ndim
        source[axis] = slice(None, -1)
        shifted[tuple(into)] = out[tuple(source)]
        out = shifted
    return xp.flip(out, axis) if reverse else out

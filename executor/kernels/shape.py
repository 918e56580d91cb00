"""Shape manipulation: Shape, Reshape, Transpose, (Un)Squeeze, Concat, Split, Slice, ..."""

from __future__ import annotations

import math

import numpy as np

from ..memory import check_allocation
from ..registry import kernel
from ._util import norm_axis


def _ints(ctx, array) -> list[int]:
    return [] if array is None else ctx.host_ints(array)


@kernel("Identity")
def identity(ctx, node, x):
    return x


@kernel("Constant")
def constant(ctx, node):
    attrs = node.attrs
    if "value" in attrs:
        value = attrs["value"]
    elif "value_float" in attrs:
        value = np.array(attrs["value_float"], dtype=np.float32)
    elif "value_floats" in attrs:
        value = np.array(attrs["value_floats"], dtype=np.float32)
    elif "value_int" in attrs:
        value = np.array(attrs["value_int"], dtype=np.int64)
    elif "value_ints" in attrs:
        value = np.array(attrs["value_ints"], dtype=np.int64)
    elif "sparse_value" in attrs:
        raise NotImplementedError("sparse Constant values are not supported")
    else:
        raise ValueError("Constant node has no value attribute")
    return ctx.backend.to_device(value)


@kernel("Shape")
def shape(ctx, node, x):
    dims = list(x.shape)
    rank = len(dims)
    start = node.attr("start")
    end = node.attrs.get("end", rank)
    start = min(max(start + rank if start < 0 else start, 0), rank)
    end = min(max(end + rank if end < 0 else end, 0), rank)
    return ctx.device_ints(dims[start:end])


@kernel("Size")
def size(ctx, node, x):
    return ctx.device_ints(x.size)


@kernel("Reshape", since=5)
def reshape(ctx, node, x, shape_tensor):
    target = ctx.host_ints(shape_tensor)
    if not node.attr("allowzero"):
        target = [x.shape[i] if d == 0 else d for i, d in enumerate(target)]
    return x.reshape(target)


@kernel("Flatten")
def flatten(ctx, node, x):
    axis = norm_axis(node.attr("axis"), x.ndim)
    outer = math.prod(x.shape[:axis])  # math.prod: np.prod of a tuple costs microseconds
    return x.reshape(outer, -1) if x.size else x.reshape(outer, math.prod(x.shape[axis:]))


@kernel("Transpose")
def transpose(ctx, node, x):
    perm = node.attrs.get("perm")
    # A view: consumers (matmul, elementwise) accept strided input, copies happen only
    # where an op needs contiguous memory.
    return ctx.xp.transpose(x, perm if perm is not None else None)


@kernel("Squeeze", since=1, until=12)
def squeeze_attr(ctx, node, x):
    axes = node.attrs.get("axes")
    return _squeeze(ctx, x, axes)


@kernel("Squeeze", since=13)
def squeeze(ctx, node, x, axes=None):
    return _squeeze(ctx, x, None if axes is None else ctx.host_ints(axes))


def _squeeze(ctx, x, axes):
    if axes is None:
        return ctx.xp.squeeze(x)
    return ctx.xp.squeeze(x, axis=tuple(norm_axis(a, x.ndim) for a in axes))


@kernel("Unsqueeze", since=1, until=12)
def unsqueeze_attr(ctx, node, x):
    return _unsqueeze(x, node.attrs["axes"])


@kernel("Unsqueeze", since=13)
def unsqueeze(ctx, node, x, axes):
    return _unsqueeze(x, ctx.host_ints(axes))


def _unsqueeze(x, axes):
    rank = x.ndim + len(axes)
    axes = sorted(norm_axis(a, rank) for a in axes)
    shape = list(x.shape)
    for a in axes:
        shape.insert(a, 1)
    return x.reshape(shape)


@kernel("Concat")
def concat(ctx, node, *xs):
    axis = norm_axis(node.attrs["axis"], xs[0].ndim)
    return ctx.xp.concatenate([x for x in xs if x is not None], axis=axis)


def split_sizes(dim: int, sizes: list[int] | None, num_outputs: int) -> list[int]:
    if sizes:
        return sizes
    chunk = -(-dim // num_outputs)  # ceil: the last piece may be smaller (opset 18 rule)
    return [min(chunk, dim - i * chunk) for i in range(num_outputs)]


def split_array(xp, x, axis: int, sizes: list[int]):
    offsets = np.cumsum(sizes)[:-1].tolist()
    return tuple(xp.split(x, offsets, axis=axis))


@kernel("Split", since=1, until=12)
def split_attr(ctx, node, x, split=None):
    axis = norm_axis(node.attr("axis"), x.ndim)
    sizes = node.attrs.get("split") or _ints(ctx, split)
    return split_array(ctx.xp, x, axis, split_sizes(x.shape[axis], sizes, node.num_outputs))


@kernel("Split", since=13)
def split(ctx, node, x, split=None):
    axis = norm_axis(node.attr("axis"), x.ndim)
    count = node.attrs.get("num_outputs", node.num_outputs)
    return split_array(ctx.xp, x, axis, split_sizes(x.shape[axis], _ints(ctx, split), count))


def slice_index(shape, starts, ends, axes, steps):
    """The tuple of python slices an ONNX Slice denotes (clamping as the spec says)."""
    rank = len(shape)
    axes = list(range(len(starts))) if axes is None else [norm_axis(a, rank) for a in axes]
    steps = [1] * len(starts) if steps is None else steps
    index = [slice(None)] * rank
    for start, end, axis, step in zip(starts, ends, axes, steps, strict=True):
        dim = shape[axis]
        if step == 0:
            raise ValueError("Slice step cannot be 0")
        start = start + dim if start < 0 else start
        end = end + dim if end < 0 else end
        if step > 0:
            start, end = min(max(start, 0), dim), min(max(end, 0), dim)
        else:
            start, end = min(max(start, -1), dim - 1), min(max(end, -1), dim - 1)
        index[axis] = slice(start, end if end >= 0 else None, step)
    return tuple(index)


@kernel("Slice", since=1, until=9)
def slice_attr(ctx, node, x):
    a = node.attrs
    return x[slice_index(x.shape, a["starts"], a["ends"], a.get("axes"), None)]


@kernel("Slice", since=10)
def slice_(ctx, node, x, starts, ends, axes=None, steps=None):
    index = slice_index(
        x.shape, ctx.host_ints(starts), ctx.host_ints(ends),
        None if axes is None else ctx.host_ints(axes),
        None if steps is None else ctx.host_ints(steps),
    )
    return x[index]


@kernel("Expand", since=8)
def expand(ctx, node, x, shape_tensor):
    target = ctx.host_ints(shape_tensor)
    out_shape = np.broadcast_shapes(tuple(x.shape), tuple(target))
    check_allocation(ctx, node, out_shape, x.dtype)
    return ctx.xp.broadcast_to(x, out_shape).copy()


@kernel("Tile", since=6)
def tile(ctx, node, x, repeats):
    repeats = ctx.host_ints(repeats)
    check_allocation(ctx, node, [d * r for d, r in zip(x.shape, repeats, strict=False)],
                     x.dtype)
    return ctx.xp.tile(x, repeats)


@kernel("Range", since=11)
def range_(ctx, node, start, limit, delta):
    s, lim, d = (ctx.host_scalar(v) for v in (start, limit, delta))
    count = max(int(np.ceil((lim - s) / d)), 0)
    check_allocation(ctx, node, [count], start.dtype)
    out = ctx.xp.arange(count, dtype=start.dtype)  # start + i * delta, in place: one array
    out *= delta.reshape(())
    out += start.reshape(())
    return out


@kernel("ConstantOfShape", since=9)
def constant_of_shape(ctx, node, shape_tensor):
    value = node.attrs.get("value")
    value = np.zeros(1, dtype=np.float32) if value is None else value
    shape = ctx.host_ints(shape_tensor)
    check_allocation(ctx, node, shape, value.dtype)
    return ctx.xp.full(shape, value.reshape(-1)[0], dtype=value.dtype)


@kernel("Trilu", since=14)
def trilu(ctx, node, x, k=None):
    k = 0 if k is None else ctx.host_scalar(k)
    xp = ctx.xp
    return xp.triu(x, k) if node.attr("upper") else xp.tril(x, k)


@kernel("Pad", since=11)
def pad(ctx, node, x, pads, constant_value=None, axes=None):
    rank = x.ndim
    pads = ctx.host_ints(pads)
    axes = list(range(rank)) if axes is None else [norm_axis(a, rank) for a in ctx.host_ints(axes)]
    widths = [(0, 0)] * rank
    n = len(axes)
    for i, axis in enumerate(axes):
        widths[axis] = (pads[i], pads[i + n])
    mode = node.attr("mode")
    xp = ctx.xp
    # negative pads crop
    crop = tuple(slice(-b if b < 0 else 0, x.shape[i] + a if a < 0 else None)
                 for i, (b, a) in enumerate(widths))
    x = x[crop]
    widths = [(max(b, 0), max(a, 0)) for b, a in widths]
    check_allocation(ctx, node, [d + b + a for d, (b, a) in zip(x.shape, widths, strict=True)],
                     x.dtype)
    if mode == "constant":
        value = (0 if constant_value is None or constant_value.size == 0
                 else ctx.host_scalar(constant_value))
        return xp.pad(x, widths, mode="constant", constant_values=value)
    return xp.pad(x, widths, mode={"reflect": "reflect", "edge": "edge", "wrap": "wrap"}[mode])


@kernel("DepthToSpace")
def depth_to_space(ctx, node, x):
    b = node.attrs["blocksize"]
    n, c, h, w = x.shape
    if node.attr("mode") == "DCR":
        y = x.reshape(n, b, b, c // (b * b), h, w).transpose(0, 3, 4, 1, 5, 2)
    else:
        y = x.reshape(n, c // (b * b), b, b, h, w).transpose(0, 1, 4, 2, 5, 3)
    return y.reshape(n, c // (b * b), h * b, w * b)


@kernel("SpaceToDepth")
def space_to_depth(ctx, node, x):
    b = node.attrs["blocksize"]
    n, c, h, w = x.shape
    y = x.reshape(n, c, h // b, b, w // b, b)
    if node.attrs.get("mode", "DCR") == "CRD":
        y = y.transpose(0, 1, 3, 5, 2, 4)
    else:
        y = y.transpose(0, 3, 5, 1, 2, 4)
    return y.reshape(n, c * b * b, h // b, w // b)


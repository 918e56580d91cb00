"""Convolution (lowered to GEMM via im2col), ConvTranspose, ConvGrad and pooling."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import gemm
from ..registry import MS_DOMAIN, kernel


@dataclass(frozen=True)
class Window:
    """Geometry of a sliding window over the spatial dims (all tuples of length ndim)."""

    kernel: tuple
    strides: tuple
    dilations: tuple
    pad_begin: tuple
    pad_end: tuple  # includes any extra room ceil_mode needs
    out: tuple

    @property
    def size(self) -> int:
        return int(np.prod(self.kernel))


def window_geometry(attrs, spatial, kernel_shape, ceil_mode=False) -> Window:
    nd = len(spatial)
    strides = tuple(attrs.get("strides") or [1] * nd)
    dilations = tuple(attrs.get("dilations") or [1] * nd)
    pads = list(attrs.get("pads") or [0] * (2 * nd))
    auto_pad = attrs.get("auto_pad", "NOTSET")
    extent = [(k - 1) * d + 1 for k, d in zip(kernel_shape, dilations, strict=True)]
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        for i in range(nd):
            out = -(-spatial[i] // strides[i])
            total = max((out - 1) * strides[i] + extent[i] - spatial[i], 0)
            small, big = total // 2, total - total // 2
            pads[i], pads[i + nd] = (small, big) if auto_pad == "SAME_UPPER" else (big, small)
    elif auto_pad == "VALID":
        pads = [0] * (2 * nd)
    begin, end = pads[:nd], pads[nd:]
    out = []
    for i in range(nd):
        span = spatial[i] + begin[i] + end[i] - extent[i]
        n = (-(-span // strides[i]) if ceil_mode else span // strides[i]) + 1
        if ceil_mode and (n - 1) * strides[i] >= spatial[i] + begin[i]:
            n -= 1  # a window must start inside the input or its left padding
        out.append(n)
    pad_end = tuple(
        max(end[i], (out[i] - 1) * strides[i] + extent[i] - spatial[i] - begin[i])
        for i in range(nd)
    )
    return Window(tuple(kernel_shape), strides, dilations, tuple(begin), pad_end, tuple(out))


def _pad(xp, x, w: Window, value=0.0):
    if not any(w.pad_begin) and not any(w.pad_end):
        return x
    widths = [(0, 0), (0, 0)] + list(zip(w.pad_begin, w.pad_end, strict=True))
    return xp.pad(x, widths, mode="constant", constant_values=value)


def _offsets(w: Window):
    return np.ndindex(*w.kernel)


def _window_slices(w: Window, offset):
    return tuple(
        slice(o * d, o * d + (n - 1) * s + 1, s)
        for o, d, n, s in zip(offset, w.dilations, w.out, w.strides, strict=True)
    )


def im2col(xp, x, w: Window, pad_value=0.0):
    """(N, C, *spatial) -> (N, C, K, *out) with K = prod(kernel), one slice copy per offset."""
    padded = _pad(xp, x, w, pad_value)
    n, c = x.shape[:2]
    cols = xp.empty((n, c, w.size) + w.out, dtype=x.dtype)
    for k, offset in enumerate(_offsets(w)):
        cols[:, :, k] = padded[(slice(None), slice(None)) + _window_slices(w, offset)]
    return cols


def col2im(xp, cols, w: Window, spatial):
    """Inverse scatter-add of im2col: (N, C, K, *out) -> (N, C, *spatial)."""
    n, c = cols.shape[:2]
    padded_shape = tuple(s + b + e for s, b, e in zip(spatial, w.pad_begin, w.pad_end, strict=True))
    padded = xp.zeros((n, c) + padded_shape, dtype=cols.dtype)
    for k, offset in enumerate(_offsets(w)):
        padded[(slice(None), slice(None)) + _window_slices(w, offset)] += cols[:, :, k]
    crop = tuple(slice(b, b + s) for b, s in zip(w.pad_begin, spatial, strict=True))
    return padded[(slice(None), slice(None)) + crop]


def _grouped_cols(cols, group):
    n, c, k = cols.shape[:3]
    return cols.reshape(n, group, (c // group) * k, -1)  # (N, G, C/G*K, P)


@kernel("Conv", gemm=True)
def conv(ctx, node, x, weight, bias=None):
    xp = ctx.xp
    group = node.attr("group")
    kernel_shape = node.attrs.get("kernel_shape") or list(weight.shape[2:])
    w = window_geometry(node.attrs, x.shape[2:], kernel_shape)
    cols = _grouped_cols(im2col(xp, x, w), group)
    m = weight.shape[0]
    wmat = weight.reshape(group, m // group, -1)  # (G, M/G, C/G*K)
    y = gemm.matmul(ctx, wmat, cols, op="conv_fwd")  # (N, G, M/G, P)
    y = y.reshape((x.shape[0], m) + w.out)
    if bias is not None:
        y += bias.reshape((1, -1) + (1,) * len(w.out))
    return y


@kernel("ConvTranspose", gemm=True)
def conv_transpose(ctx, node, x, weight, bias=None):
    xp = ctx.xp
    attrs = node.attrs
    group = node.attr("group")
    nd = x.ndim - 2
    kernel_shape = attrs.get("kernel_shape") or list(weight.shape[2:])
    strides = attrs.get("strides") or [1] * nd
    dilations = attrs.get("dilations") or [1] * nd
    out_pad = attrs.get("output_padding") or [0] * nd
    in_spatial = x.shape[2:]
    full = [s * (i - 1) + op + (k - 1) * d + 1
            for s, i, op, k, d in zip(strides, in_spatial, out_pad, kernel_shape, dilations,
                                      strict=True)]
    pads = list(attrs.get("pads") or [0] * (2 * nd))
    auto_pad = node.attr("auto_pad")
    if attrs.get("output_shape") or auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        target = (attrs.get("output_shape")
                  or [i * s for i, s in zip(in_spatial, strides, strict=True)])
        target = list(target)[-nd:]
        for i in range(nd):
            total = full[i] - target[i]
            small, big = total // 2, total - total // 2
            pads[i], pads[i + nd] = (small, big) if auto_pad != "SAME_LOWER" else (big, small)
    out_spatial = [f - pads[i] - pads[i + nd] for i, f in enumerate(full)]
    pads = [max(p, 0) for p in pads]
    # The forward of ConvTranspose is a convolution's backward-data GEMM (as in MIOpen).
    c, m_per_group = weight.shape[0], weight.shape[1]
    wmat = weight.reshape(group, c // group, -1).swapaxes(1, 2)  # (G, M/G*K, C/G)
    xg = x.reshape(x.shape[0], group, c // group, -1)  # (N, G, C/G, P_in)
    cols = gemm.matmul(ctx, wmat, xg, op="conv_bwd_data")  # (N, G, M/G*K, P_in)
    w = Window(tuple(kernel_shape), tuple(strides), tuple(dilations), (0,) * nd,
               tuple(op for op in out_pad), tuple(in_spatial))
    cols = cols.reshape((x.shape[0], group * m_per_group, int(np.prod(kernel_shape)))
                        + tuple(in_spatial))
    y = col2im(xp, cols, w, tuple(f - op for f, op in zip(full, out_pad, strict=True)))
    if any(out_pad):
        y = xp.pad(y, [(0, 0), (0, 0)] + [(0, op) for op in out_pad])
    short = [max(pads[i] + out_spatial[i] - y.shape[2 + i], 0) for i in range(nd)]
    if any(short):  # output_shape asks for more than the natural size: zeros at the end
        y = xp.pad(y, [(0, 0), (0, 0)] + [(0, s) for s in short])
    crop = tuple(slice(max(pads[i], 0), max(pads[i], 0) + out_spatial[i]) for i in range(nd))
    y = y[(slice(None), slice(None)) + crop]
    if bias is not None:
        y = y + bias.reshape((1, -1) + (1,) * nd)
    return xp.ascontiguousarray(y)


@kernel("ConvGrad", domain=MS_DOMAIN, gemm=True)
def conv_grad(ctx, node, dy, x, weight):
    """dX, dW, dB of Conv(x, weight[, bias]) given dY; each as a single GEMM."""
    xp = ctx.xp
    group = node.attr("group")
    kernel_shape = node.attrs.get("kernel_shape") or list(weight.shape[2:])
    w = window_geometry(node.attrs, x.shape[2:], kernel_shape)
    n, m = dy.shape[:2]
    dy_g = dy.reshape(n, group, m // group, -1)  # (N, G, M/G, P)
    wants = [bool(name) for name in node.outputs] + [False] * (3 - node.num_outputs)
    dx = dw = db = None
    if wants[1]:
        cols = _grouped_cols(im2col(xp, x, w), group)  # (N, G, CK, P)
        # one GEMM over the batch: (G, M/G, N*P) @ (G, N*P, CK)
        lhs = dy_g.transpose(1, 2, 0, 3).reshape(group, m // group, -1)
        rhs = cols.transpose(1, 0, 3, 2).reshape(group, -1, cols.shape[2])
        dw = gemm.matmul(ctx, lhs, rhs, op="conv_bwd_weights").reshape(weight.shape)
    if wants[0]:
        wmat = weight.reshape(group, m // group, -1).swapaxes(1, 2)  # (G, CK, M/G)
        dcols = gemm.matmul(ctx, wmat, dy_g, op="conv_bwd_data")  # (N, G, CK, P)
        dcols = dcols.reshape((n, x.shape[1], w.size) + w.out)
        dx = xp.ascontiguousarray(col2im(xp, dcols, w, x.shape[2:]))
    if wants[2]:
        db = dy.sum(axis=(0,) + tuple(range(2, dy.ndim)))
    return dx, dw, db


# ---- pooling -------------------------------------------------------------------------
def _pool_windows(ctx, node, x, pad_value):
    w = window_geometry(node.attrs, x.shape[2:], node.attrs["kernel_shape"],
                        bool(node.attr("ceil_mode")))
    return w, im2col(ctx.xp, x, w, pad_value)  # (N, C, K, *out)


@kernel("MaxPool")
def max_pool(ctx, node, x):
    xp = ctx.xp
    fill = -np.inf if x.dtype.kind == "f" else np.iinfo(x.dtype).min
    w, cols = _pool_windows(ctx, node, x, fill)
    y = cols.max(axis=2)
    if node.num_outputs < 2 or not node.outputs[1]:
        return y
    arg = cols.argmax(axis=2)  # (N, C, *out)
    nd = len(w.out)
    offsets = np.array(list(_offsets(w)), dtype=np.int64)  # (K, nd)
    spatial = x.shape[2:]
    flat = xp.zeros(arg.shape, dtype=np.int64)
    column_major = node.attr("storage_order") == 1
    order = range(nd - 1, -1, -1) if column_major else range(nd)
    for i in order:
        grid_shape = [1] * nd
        grid_shape[i] = -1
        start = (xp.arange(w.out[i]) * w.strides[i] - w.pad_begin[i]).reshape(grid_shape)
        coord = start + xp.asarray(offsets[:, i])[arg] * w.dilations[i]
        flat = flat * spatial[i] + coord
    plane = int(np.prod(spatial))
    nc = xp.arange(x.shape[0] * x.shape[1]).reshape(x.shape[:2] + (1,) * nd)
    return y, flat + nc * plane


@kernel("AveragePool")
def average_pool(ctx, node, x):
    xp = ctx.xp
    w, cols = _pool_windows(ctx, node, x, 0.0)
    total = cols.sum(axis=2)
    # Divisor: window elements inside the input (count_include_pad=0) or inside the
    # input plus its declared pads (=1); room added only for ceil_mode never counts.
    nd = len(w.out)
    attrs = node.attrs
    declared = list(attrs.get("pads") or [0] * (2 * nd))
    ones_shape = (1, 1) + tuple(x.shape[2:])
    ones = xp.ones(ones_shape, dtype=x.dtype)
    if node.attr("count_include_pad") and node.attr("auto_pad") == "NOTSET":
        ones = xp.pad(ones, [(0, 0), (0, 0)] + [(declared[i], declared[i + nd]) for i in range(nd)],
                      constant_values=1)
        inner = Window(w.kernel, w.strides, w.dilations, (0,) * nd,
                       tuple(e - declared[i + nd] for i, e in enumerate(w.pad_end)), w.out)
        counts = im2col(xp, ones, inner).sum(axis=2)
    else:
        counts = im2col(xp, ones, w).sum(axis=2)
    return (total / counts).astype(x.dtype, copy=False)


@kernel("GlobalAveragePool")
def global_average_pool(ctx, node, x):
    return x.mean(axis=tuple(range(2, x.ndim)), keepdims=True).astype(x.dtype, copy=False)


@kernel("GlobalMaxPool")
def global_max_pool(ctx, node, x):
    return x.max(axis=tuple(range(2, x.ndim)), keepdims=True)


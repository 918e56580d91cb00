"""com.microsoft ops of ONNX Runtime training graphs: YieldOp and the gradient kernels."""

from __future__ import annotations

import math

import numpy as np

from graphopt.vocabulary import YIELD_OP

from ..errors import FeedError
from ..registry import MS_DOMAIN, kernel
from ._compiled import compiled_kernels
from ._scatter import check_bounds, scatter_rows
from ._threads import rows_per_block, run_rows
from ._util import (
    bias_gelu_exact_grad_from_output,
    column_dots,
    column_sums,
    compute_dtype,
    gelu_exact_grad,
    gelu_exact_grad_from_output,
    gelu_tanh_grad_times,
    norm_axis,
    row_dots,
    row_sums,
    summed_by_rows,
)
from .nn import as_rows, coerced_axes, empty_in_order, per_row_params, single_axis
from .reduce import reduce_axes, reduce_sum
from .shape import slice_index, split_array, split_sizes


def _ms(*op_types, **kw):
    return kernel(*op_types, domain=MS_DOMAIN, **kw)


@_ms(YIELD_OP)
def yield_op(ctx, node, *module_outputs):
    """Hands the module outputs' gradients over: caller-fed by output name, else ones."""
    skipped = set(node.attrs.get("non_differentiable_outputs", []))
    differentiable = [x for i, x in enumerate(module_outputs) if i not in skipped]
    grads = []
    for name, forward in zip(node.outputs, differentiable, strict=False):
        fed = ctx.yield_feeds.get(name)
        if fed is None:
            grads.append(ctx.xp.ones(forward.shape, dtype=forward.dtype))
            continue
        if tuple(fed.shape) != tuple(forward.shape) or fed.dtype != forward.dtype:
            raise FeedError(
                f"feed {name!r} (gradient handed to YieldOp) has shape {tuple(fed.shape)} "
                f"{fed.dtype}; the module output is {tuple(forward.shape)} {forward.dtype}"
            )
        grads.append(fed)
    return tuple(grads)


def _softmax_grad(ctx, dy, y, axes):
    xp = ctx.xp
    ct = compute_dtype(y.dtype)
    y32, dy32 = y.astype(ct, copy=False), dy.astype(ct, copy=False)
    if summed_by_rows(ct) and y.size and axes[-1] == y.ndim - 1 and dy.shape == y.shape:
        # trailing axes: (rows, D) views, the row sums by einsum, the result into dy when
        # it is donated (dy is read elementwise before its element is written)
        laid_out = _rows_in_memory_order(y32, dy32, axes)
        if laid_out is not None:
            # y and dy share a layout in which the rows are dense (the attention
            # probabilities and their gradient, (b, h, s, t) over (b, s, h, t) memory, as
            # Softmax left them): rows in memory order, dx in that layout too, no copies
            order, y2, dy2 = laid_out
            out = (ctx.out_for(dy.shape, dy.dtype, dy, any_layout=True) if ct == dy.dtype
                   else None)
            if out is None or out.strides != y32.strides:
                out = empty_in_order(xp, y.shape, order, ct)
            dx = out.transpose(order).reshape(y2.shape)
        else:
            rows = math.prod(y.shape[:axes[0]])
            y2, dy2 = y32.reshape(rows, -1), dy32.reshape(rows, -1)
            out = ctx.out_for(dy.shape, dy.dtype, dy) if ct == dy.dtype else None
            if out is None or not out.flags.c_contiguous:  # (its (rows, D) view: a copy)
                # allocated in y's shape, not as a (rows, D) array reshaped: a view (an
                # array with a base) is not donated to the next in-place kernel
                out = xp.empty(y.shape, ct)
            dx = out.reshape(y2.shape)
        compiled = compiled_kernels(xp, ct, y2.size)

        def rows_of(lo, hi):  # a block's rows of dy are read before they are written
            if compiled is not None:
                compiled.softmax_grad_rows(dy2[lo:hi], y2[lo:hi], dx[lo:hi])
                return
            total = row_dots(xp, y2[lo:hi], dy2[lo:hi])
            block = xp.subtract(dy2[lo:hi], total[:, None], out=dx[lo:hi])
            block *= y2[lo:hi]

        run_rows(xp, rows_of, y2.shape[0], y2.shape[1])
        return out.astype(y.dtype, copy=False)
    # y * (dy - sum(y * dy)) in one buffer: the product's, reused once it is summed
    dx = y32 * dy32
    total = dx.sum(axis=axes, keepdims=True)
    xp.subtract(dy32, total, out=dx)
    dx *= y32
    return dx.astype(y.dtype, copy=False)


def _rows_in_memory_order(y, dy, axes):
    """(order, y2, dy2) when y and dy, not C-contiguous, have the same strides and are dense
    with the softmax axes innermost in some order of the others (nn.as_rows), else None."""
    if y.flags.c_contiguous or y.strides != dy.strides:
        return None
    rows = as_rows(y, axes)
    if rows is None:
        return None
    order, y2 = rows
    return order, y2, dy.transpose(order).reshape(y2.shape)


@_ms("SoftmaxGrad", inplace=True)
def softmax_grad(ctx, node, dy, y):
    return _softmax_grad(ctx, dy, y, coerced_axes(node, y, 1))


@_ms("SoftmaxGrad_13", inplace=True)
def softmax_grad_13(ctx, node, dy, y):
    return _softmax_grad(ctx, dy, y, single_axis(node, y))


def _log_softmax_grad(xp, dy, log_y, axes):
    return (dy - xp.exp(log_y) * dy.sum(axis=axes, keepdims=True)).astype(dy.dtype, copy=False)


@_ms("LogSoftmaxGrad")
def log_softmax_grad(ctx, node, dy, log_y):
    return _log_softmax_grad(ctx.xp, dy, log_y, coerced_axes(node, log_y, 1))


@_ms("LogSoftmaxGrad_13")
def log_softmax_grad_13(ctx, node, dy, log_y):
    return _log_softmax_grad(ctx.xp, dy, log_y, single_axis(node, log_y))


@_ms("GatherGrad")
def gather_grad(ctx, node, shape, indices, dy):
    xp = ctx.xp
    shape = ctx.host_ints(shape)
    axis = norm_axis(node.attr("axis"), len(shape))
    indices = xp.where(indices < 0, indices + shape[axis], indices)
    check_bounds(ctx, indices, shape[axis], "GatherGrad")
    # an embedding's gradient is large and mostly zeros: a spare array (a recycled gradient)
    # zeroed costs one pass over warm memory, a fresh one a page fault per page written
    dx = ctx.large_out(tuple(shape), dy.dtype)
    if dx is None:
        dx = xp.zeros(shape, dtype=dy.dtype)
    else:
        dx.fill(0)
    outer = math.prod(shape[:axis])
    inner = math.prod(shape[axis + 1:])
    n = int(indices.size)
    # Deterministic on every device (no atomics): see _scatter. Rows are (outer, index)
    # pairs of the (outer * dim, inner) view of dx, in dy's order.
    rows = indices.reshape(1, n).astype(np.int64) + (
        xp.arange(outer, dtype=np.int64).reshape(outer, 1) * shape[axis])
    scatter_rows(ctx, dx.reshape(outer * shape[axis], inner), rows.reshape(-1),
                 dy.reshape(outer * n, inner), "add")
    return dx


@_ms("SliceGrad")
def slice_grad(ctx, node, dy, shape, starts, ends, axes=None, steps=None):
    shape = ctx.host_ints(shape)
    dx = ctx.xp.zeros(shape, dtype=dy.dtype)
    index = slice_index(
        shape, ctx.host_ints(starts), ctx.host_ints(ends),
        None if axes is None else ctx.host_ints(axes),
        None if steps is None else ctx.host_ints(steps),
    )
    dx[index] = dy
    return dx


@_ms("ConcatTraining")
def concat_training(ctx, node, *xs):
    xs = [x for x in xs if x is not None]
    axis = norm_axis(node.attrs["axis"], xs[0].ndim)
    lengths = ctx.xp.asarray(np.array([x.shape[axis] for x in xs], dtype=np.int64))
    return ctx.xp.concatenate(xs, axis=axis), lengths


@_ms("SplitTraining")
def split_training(ctx, node, x, split):
    axis = norm_axis(node.attr("axis"), x.ndim)
    sizes = split_sizes(x.shape[axis], ctx.host_ints(split), node.num_outputs)
    return split_array(ctx.xp, x, axis, sizes)


@_ms("ReduceSumTraining")
def reduce_sum_training(ctx, node, x, axes):
    axes_reduced = reduce_axes(ctx, node, x, axes)
    if axes_reduced is None:
        return x.copy()
    return reduce_sum(ctx.xp, x, axes_reduced, bool(node.attr("keepdims")))


@_ms("BroadcastGradientArgs")
def broadcast_gradient_args(ctx, node, a_shape, b_shape):
    """Output axes along which each operand was broadcast (to be summed in its gradient)."""
    a, b = ctx.host_ints(a_shape), ctx.host_ints(b_shape)
    rank = max(len(a), len(b))
    a_full, b_full = [1] * (rank - len(a)) + a, [1] * (rank - len(b)) + b
    a_axes, b_axes = [], []
    for i, (da, db) in enumerate(zip(a_full, b_full, strict=True)):
        out = max(da, db)
        if i < rank - len(a) or (da == 1 and out != 1):
            a_axes.append(i)
        if i < rank - len(b) or (db == 1 and out != 1):
            b_axes.append(i)
    to_dev = ctx.backend.to_device
    return to_dev(np.array(a_axes, dtype=np.int64)), to_dev(np.array(b_axes, dtype=np.int64))


# ---- activation gradients ------------------------------------------------------------
def _with_dtype(fn, dy, x, *extra):
    ct = compute_dtype(x.dtype)
    args = [a.astype(ct, copy=False) for a in (dy, x) + extra]
    return fn(*args).astype(x.dtype, copy=False)


@_ms("ReluGrad")
def relu_grad(ctx, node, dy, x):
    return ctx.xp.where(x > 0, dy, 0).astype(dy.dtype, copy=False)


def _forward_gelu(node, earlier_readers) -> dict[str, str]:
    """GeluGrad(dY, X) reads gelu(X) when the run computed it before: the output of an exact
    GeLU of the same X (com.microsoft Gelu, ONNX Gelu with approximate 'none');
    BiasGeluGrad_dX(dY, X, B) the output of BiasGelu(X, B)."""
    arguments = node.inputs[1:]
    if not arguments or not all(arguments):
        return {}
    for reader in earlier_readers(arguments[0]):
        if reader.op_type == "BiasGelu":
            exact = reader.domain == MS_DOMAIN and node.op_type == "BiasGeluGrad_dX"
        else:
            exact = (reader.op_type == "Gelu" and node.op_type == "GeluGrad"
                     and (reader.domain == MS_DOMAIN
                          or (reader.domain == "" and reader.attr("approximate") == "none")))
        if exact and reader.inputs == arguments and reader.outputs[:1] != ("",):
            return {"gelu_x": reader.outputs[0]}
    return {}


def _from_forward(ctx, dy, x, gelu_x) -> bool:
    """Whether the gradient can be read off the forward's float32 NumPy GeLU ``gelu_x``."""
    return (ctx.xp is np and gelu_x is not None and x.dtype == np.float32
            and dy.dtype == np.float32 and gelu_x.dtype == np.float32
            and gelu_x.shape == x.shape == dy.shape)


@_ms("GeluGrad", reads_also=_forward_gelu)
def gelu_grad(ctx, node, dy, x, gelu_x=None):
    if _from_forward(ctx, dy, x, gelu_x):  # Phi(x) off gelu(x): the erf is most of the work
        return gelu_exact_grad_from_output(dy, x, gelu_x)
    return _with_dtype(lambda g, v: g * gelu_exact_grad(ctx.xp, v), dy, x)


@_ms("FastGeluGrad")
def fast_gelu_grad(ctx, node, dy, x):
    return _with_dtype(lambda g, v: gelu_tanh_grad_times(ctx.xp, g, v), dy, x)


@_ms("BiasGeluGrad_dX", reads_also=_forward_gelu)
def bias_gelu_grad_dx(ctx, node, dy, x, bias, gelu_x=None):
    if _from_forward(ctx, dy, x, gelu_x) and bias.dtype == np.float32:
        fused = bias_gelu_exact_grad_from_output(dy, x, bias, gelu_x)  # compiled, one pass
        return fused if fused is not None else gelu_exact_grad_from_output(dy, x + bias, gelu_x)
    return _with_dtype(lambda g, v, b: g * gelu_exact_grad(ctx.xp, v + b), dy, x, bias)


@_ms("BiasFastGeluGrad_dX")
def bias_fast_gelu_grad_dx(ctx, node, dy, x, bias):
    return _with_dtype(lambda g, v, b: gelu_tanh_grad_times(ctx.xp, g, v + b), dy, x, bias)


@_ms("BatchNormInternal")
def batch_norm_training(ctx, node, x, scale, bias, mean, var, training_mode=None):
    """ONNX Runtime's training BatchNormalization: (Y, running mean, running var, batch
    mean, batch inverse std). The batch statistics are over every axis but the channels
    (1); the running variance takes the unbiased batch variance, as PyTorch and cuDNN do.
    In Session.inference_mode (a held-out evaluation) it normalises with the running statistics
    and returns them unchanged, as model.eval() does."""
    xp = ctx.xp
    epsilon = node.attr("epsilon")
    channels = (1, -1) + (1,) * (x.ndim - 2)
    ct = np.promote_types(compute_dtype(x.dtype), mean.dtype)
    x_c = x.astype(ct, copy=False)
    training = node.attr("training_mode") != 0 if training_mode is None \
        else bool(ctx.host_scalar(training_mode))
    training = training and not ctx.evaluating
    if training:
        axes = (0,) + tuple(range(2, x.ndim))
        batch_mean = x_c.mean(axis=axes)
        centered = x_c - batch_mean.reshape(channels)
        batch_var = xp.square(centered).mean(axis=axes)
        count = x.size // max(x.shape[1], 1)
        momentum = node.attr("momentum")
        unbiased = batch_var * (count / (count - 1)) if count > 1 else batch_var
        running_mean = mean * momentum + batch_mean * (1 - momentum)
        running_var = var * momentum + unbiased * (1 - momentum)
    else:
        batch_mean, batch_var = mean.astype(ct), var.astype(ct)
        centered = x_c - batch_mean.reshape(channels)
        running_mean, running_var = mean, var
    inv_std = 1 / xp.sqrt(batch_var + epsilon)
    y = centered
    y *= (inv_std * scale.astype(ct, copy=False)).reshape(channels)
    y += bias.astype(ct, copy=False).reshape(channels)
    stat = mean.dtype
    return (y.astype(x.dtype, copy=False), running_mean.astype(stat, copy=False),
            running_var.astype(stat, copy=False), batch_mean.astype(stat, copy=False),
            inv_std.astype(stat, copy=False))


@_ms("BatchNormalizationGrad")
def batch_normalization_grad(ctx, node, dy, x, scale, mean, inv_std):
    """d(X, scale, B) of training-mode BatchNormalization, from the batch statistics:
    dX = scale * inv_std * (dY - mean(dY) - xhat * mean(dY * xhat)), over every axis but
    the channels (1)."""
    channels = (1, -1) + (1,) * (x.ndim - 2)
    axes = (0,) + tuple(range(2, x.ndim))
    ct = np.promote_types(compute_dtype(x.dtype), mean.dtype)
    dy_c = dy.astype(ct, copy=False)
    xhat = x.astype(ct, copy=False) - mean.astype(ct, copy=False).reshape(channels)
    xhat *= inv_std.astype(ct, copy=False).reshape(channels)
    bias_grad = dy_c.sum(axis=axes)
    scale_grad = (dy_c * xhat).sum(axis=axes)
    count = x.size // max(x.shape[1], 1)
    dx = xhat
    dx *= (scale_grad / count).reshape(channels)
    dx *= -1
    dx += dy_c
    dx -= (bias_grad / count).reshape(channels)
    dx *= (scale.astype(ct, copy=False) * inv_std.astype(ct, copy=False)).reshape(channels)
    return (dx.astype(x.dtype, copy=False), scale_grad.astype(scale.dtype, copy=False),
            bias_grad.astype(scale.dtype, copy=False))


@_ms("LayerNormalizationGrad")
def layer_normalization_grad(ctx, node, dy, x, scale, mean, inv_std):
    axis = norm_axis(node.attr("axis"), x.ndim)
    norm_axes = tuple(range(axis, x.ndim))
    lead_axes = tuple(range(axis))
    ct = np.promote_types(compute_dtype(x.dtype), mean.dtype)
    xp = ctx.xp
    if (summed_by_rows(ct) and x.size and 0 < axis and dy.shape == x.shape
            and per_row_params(x, axis, scale)):
        dx, scale_grad, bias_grad = _layer_norm_grad_rows(xp, dy, x, scale, mean, inv_std, ct)
        return (dx.astype(x.dtype, copy=False),
                scale_grad.reshape(scale.shape).astype(scale.dtype, copy=False),
                bias_grad.reshape(scale.shape).astype(scale.dtype, copy=False))
    dy_c, x_c, scale_c = (a.astype(ct, copy=False) for a in (dy, x, scale))
    # inv_std * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)) on three buffers (xhat,
    # dxhat, one scratch) instead of nine temporaries; the same operations in the same order
    xhat = x_c - mean
    xhat *= inv_std
    scratch = dy_c * xhat
    # a scale that broadcasts over some normalized axes gets their sum too
    scale_grad = _sum_to(scratch.sum(axis=lead_axes), scale.shape)
    bias_grad = _sum_to(dy_c.sum(axis=lead_axes), scale.shape)
    dxhat = dy_c * scale_c
    xp.multiply(dxhat, xhat, out=scratch)
    xhat_term = scratch.mean(axis=norm_axes, keepdims=True)
    dxhat -= dxhat.mean(axis=norm_axes, keepdims=True)
    xp.multiply(xhat, xhat_term, out=scratch)
    dxhat -= scratch
    dx = dxhat
    dx *= inv_std
    return (dx.astype(x.dtype, copy=False), scale_grad.astype(scale.dtype, copy=False),
            bias_grad.astype(scale.dtype, copy=False))


def _sum_to(grad, shape):
    """``grad`` summed over the axes along which an operand of ``shape`` was broadcast."""
    shape = tuple(shape)
    lead = grad.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(lead + i for i, n in enumerate(shape)
                                      if n == 1 and grad.shape[lead + i] != 1)
    return grad.sum(axis=axes).reshape(shape) if axes else grad.reshape(shape)


def _layer_norm_grad_rows(xp, dy, x, scale, mean, inv_std, ct):
    """float32/float64 (every backend) on (rows, D) views: the row means and the parameter
    gradients' column sums by einsum, the sums of products without their temporaries (see
    row_sums, column_sums, row_dots, column_dots)."""
    rows = mean.size
    width = x.size // rows
    dy2 = dy.astype(ct, copy=False).reshape(rows, width)
    scale1 = scale.astype(ct, copy=False).reshape(width)
    mean1, inv1 = (a.astype(ct, copy=False).reshape(rows, 1) for a in (mean, inv_std))
    x2 = x.astype(ct, copy=False).reshape(rows, width)
    # allocated in x's shape (a reshaped (rows, D) array would be a view: not donated on)
    result = xp.empty(x.shape, ct)
    dx = result.reshape(rows, width)

    compiled = compiled_kernels(xp, ct, x2.size)
    if compiled is not None:
        # one pass a row, the parameter gradients summed block by block (each block's
        # column sums in their own row of ``sums``, then the blocks added in order: the
        # same bits whichever threads ran them) and no xhat array
        scale1 = np.ascontiguousarray(scale1)
        mean_flat, inv_flat = (np.ascontiguousarray(a).reshape(rows) for a in (mean1, inv1))
        per_block = rows_per_block(width)
        sums = np.zeros((2, -(-rows // per_block), width), ct)

        def block(lo, hi):
            compiled.layer_norm_grad_rows(
                dy2[lo:hi], x2[lo:hi], scale1, mean_flat[lo:hi], inv_flat[lo:hi], dx[lo:hi],
                sums[0, lo // per_block], sums[1, lo // per_block])

        run_rows(xp, block, rows, width)
        scale_grad, bias_grad = sums.sum(axis=1)
        return result, scale_grad, bias_grad

    def normalized(lo, hi):
        block = xp.subtract(x2[lo:hi], mean1[lo:hi], out=xhat[lo:hi])
        block *= inv1[lo:hi]

    def rows_of(lo, hi):
        # inv_std * (dxhat - mean(dxhat) - xhat * mean(dxhat * xhat)), dxhat = dy * scale
        block, block_xhat = dx[lo:hi], xhat[lo:hi]
        xp.multiply(dy2[lo:hi], scale1, out=block)
        dxhat_mean = row_sums(xp, block)
        dxhat_mean /= width
        xhat_term = row_dots(xp, block, block_xhat)
        xhat_term /= width
        block -= dxhat_mean[:, None]
        block_xhat *= xhat_term[:, None]
        block -= block_xhat
        block *= inv1[lo:hi]

    # the row parts in blocks, on several threads when large; the parameter gradients'
    # column sums run over all rows in one call (their bits do not depend on any cut)
    xhat = xp.empty((rows, width), ct)
    run_rows(xp, normalized, rows, width)
    scale_grad = column_dots(xp, dy2, xhat)
    bias_grad = column_sums(xp, dy2)
    run_rows(xp, rows_of, rows, width)
    return result, scale_grad, bias_grad


@_ms("DropoutGrad")
def dropout_grad(ctx, node, dy, mask, ratio=None, training_mode=None):
    # Without a training_mode input, follow the session's mode, as the forward Dropout does:
    # otherwise a training session would drop values forward but not backward.
    training = ctx.training if training_mode is None else bool(ctx.host_scalar(training_mode))
    ratio = 0.5 if ratio is None else float(ctx.host_scalar(ratio))
    if not training or ratio == 0.0:
        return dy
    return (dy * mask * (1.0 / (1.0 - ratio))).astype(dy.dtype, copy=False)


@_ms("InPlaceAccumulatorV2")
def in_place_accumulator_v2(ctx, node, buffer, value, overwrite_flag=None):
    """Returns (updated_flag, new buffer); the new buffer is a fresh array, not an alias."""
    overwrite = overwrite_flag is not None and bool(ctx.host_scalar(overwrite_flag))
    value = value.astype(buffer.dtype, copy=False)
    updated = value.copy() if overwrite else buffer + value
    return ctx.xp.ones((1,), dtype=bool), updated


@_ms("Scale")
def scale(ctx, node, x, factor):
    factor = factor.astype(x.dtype).reshape(())
    return x / factor if node.attr("scale_down") else x * factor


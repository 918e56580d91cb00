"""Gradients of neural-network layers: convolution, pooling, normalisation, the loss."""
from __future__ import annotations

import numpy as np

from ...vocabulary import MS_DOMAIN
from ..batch_norm import TRAINING_OP as BATCH_NORM_TRAINING
from ..registry import GradientContext, gradient


@gradient("Conv")
def conv(ctx: GradientContext):
    """ONNX Runtime's ConvGrad -> dX, dW[, dB], with the forward node's attributes."""
    has_bias = bool(ctx.input(2))
    attrs = {a: ctx.attr(a) for a in ("auto_pad", "dilations", "group", "kernel_shape", "pads",
                                      "strides")}
    return ctx.ms("ConvGrad", ctx.dy, ctx.input(0), ctx.input(1), outputs=3 if has_bias else 2,
                  **attrs)


@gradient("MaxPool")
def max_pool(ctx: GradientContext):
    """Scatter-add dY at the argmax positions MaxPool reports in its Indices output.

    The executor has no MaxPoolGrad, so this uses standard ops: Indices are flat offsets
    into X (batch and channel included), so dX is a 1-D scatter-add reshaped like X.
    Overlapping windows can pick one element twice, hence add, not assign."""
    if ctx.attr_or_default("storage_order"):
        raise ctx.fail("storage_order=1 (column-major Indices) has no gradient definition")
    x = ctx.input(0)
    indices = ctx.forward_output(1, "indices")
    flat = ctx.ints([-1])
    flat_indices, flat_dy = ctx.op("Reshape", indices, flat), ctx.op("Reshape", ctx.dy, flat)
    static = ctx.emitter.types.static_shape(x)
    length = ctx.ints([int(np.prod(static))]) if static is not None else \
        ctx.op("Reshape", ctx.op("Size", x), flat)
    if ctx.opset >= 16:  # ScatterElements gained reduction="add" in opset 16
        flat_dx = ctx.op("ScatterElements", ctx.zeros(length, like=x), flat_indices, flat_dy,
                         axis=0, reduction="add")
    else:  # ONNX Runtime's GatherGrad is the same scatter-add
        flat_dx = ctx.ms("GatherGrad", length, flat_indices, flat_dy, axis=0)
    return [ctx.reshape_like(flat_dx, x)]


@gradient("LayerNormalization")
def layer_normalization(ctx: GradientContext):
    """ONNX Runtime's LayerNormalizationGrad, fed the statistics the forward pass saved."""
    if ctx.output_grad(1) or ctx.output_grad(2):
        raise ctx.fail("a gradient through its Mean/InvStdDev outputs is not supported")
    mean = ctx.forward_output(1, "mean")
    inv_std = ctx.forward_output(2, "inv_std_dev")
    return ctx.ms("LayerNormalizationGrad", ctx.dy, ctx.input(0), ctx.input(1), mean, inv_std,
                  axis=ctx.attr_or_default("axis"), outputs=3)


@gradient(BATCH_NORM_TRAINING, domain=MS_DOMAIN)
def batch_norm_training(ctx: GradientContext):
    """ONNX Runtime's BatchNormalizationGrad -> dX, dscale, dB, fed the batch mean and
    inverse standard deviation the forward pass saved (the running statistics get none)."""
    if any(ctx.output_grad(i) for i in range(1, 5)):
        raise ctx.fail("a gradient through its statistics outputs is not supported")
    mean = ctx.forward_output(3, "saved_mean")
    inv_std = ctx.forward_output(4, "saved_inv_std")
    grads = ctx.ms("BatchNormalizationGrad", ctx.dy, ctx.input(0), ctx.input(1), mean, inv_std,
                   epsilon=ctx.attr_or_default("epsilon"), outputs=3)
    return [*grads, None, None]


@gradient("SoftmaxCrossEntropyLoss")
def softmax_cross_entropy_loss(ctx: GradientContext):
    """ONNX Runtime's SoftmaxCrossEntropyLossGrad: (softmax - onehot) scaled by dY, the class
    weights and the reduction, from the log-probabilities the forward pass saved."""
    if ctx.output_grad(1):
        raise ctx.fail("a gradient through its log_prob output is not supported")
    log_prob = ctx.forward_output(1, "log_prob")
    weights = ctx.input(2) or None
    grad = ctx.ms("SoftmaxCrossEntropyLossGrad", ctx.dy, log_prob, ctx.input(1), weights,
                  reduction=ctx.attr_or_default("reduction"), ignore_index=ctx.attr("ignore_index"))
    return [grad, None, None]

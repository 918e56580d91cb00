"""Gradients of activations and normalising functions (Softmax, LogSoftmax)."""
from __future__ import annotations

import math

from ...ir import MS_DOMAIN
from ..registry import GradientContext, gradient


@gradient("Relu")
def relu(ctx: GradientContext):
    return [ctx.ms("ReluGrad", ctx.dy, ctx.input(0))]


@gradient("Gelu")  # ONNX opset 20
def gelu(ctx: GradientContext):
    # onnx hands a STRING attribute back as bytes
    grad_op = "FastGeluGrad" if ctx.attr("approximate") == b"tanh" else "GeluGrad"
    return [ctx.ms(grad_op, ctx.dy, ctx.input(0))]


@gradient("Gelu", domain=MS_DOMAIN)
def ms_gelu(ctx: GradientContext):
    return [ctx.ms("GeluGrad", ctx.dy, ctx.input(0))]


@gradient("BiasGelu", domain=MS_DOMAIN)
def ms_bias_gelu(ctx: GradientContext):
    """gelu(x + bias): d/dx is the GELU derivative at x + bias (BiasGeluGrad_dX, which reads
    it off the forward's output), d/dbias its sum over x's leading axes."""
    x, bias = ctx.input(0), ctx.input(1)
    grad = ctx.ms("BiasGeluGrad_dX", ctx.dy, x, bias)
    y_shape = ctx.shape(ctx.output(0))
    return [ctx.sum_to(grad, x, y_shape), ctx.sum_to(grad, bias, y_shape)]


@gradient("FastGelu", domain=MS_DOMAIN)
def ms_fast_gelu(ctx: GradientContext):
    if ctx.input(1):  # FastGelu(x, bias): what fast_gelu_fusion makes has no bias
        raise ctx.fail("FastGelu with a bias input is not differentiated here")
    return [ctx.ms("FastGeluGrad", ctx.dy, ctx.input(0))]


@gradient("Erf")
def erf(ctx: GradientContext):
    """d erf(x) = 2/sqrt(pi) * exp(-x^2): what exported exact GELU differentiates through."""
    x = ctx.input(0)
    slope = ctx.op("Exp", ctx.op("Neg", ctx.op("Mul", x, x)))
    return [ctx.op("Mul", ctx.op("Mul", ctx.dy, slope), ctx.scalar(2.0 / math.sqrt(math.pi), x))]


@gradient("Tanh")
def tanh(ctx: GradientContext):  # 1 - y^2
    y = ctx.output(0)
    one_minus_square = ctx.op("Sub", ctx.scalar(1.0, y), ctx.op("Mul", y, y))
    return [ctx.op("Mul", ctx.dy, one_minus_square)]


@gradient("Sigmoid")
def sigmoid(ctx: GradientContext):  # y * (1 - y)
    y = ctx.output(0)
    slope = ctx.op("Mul", y, ctx.op("Sub", ctx.scalar(1.0, y), y))
    return [ctx.op("Mul", ctx.dy, slope)]


def _softmax_family(ctx: GradientContext, grad_op: str):
    # opset 13 changed the semantics from "coerce to 2-D at axis" to "one axis"; ONNX
    # Runtime has a gradient op for each
    if ctx.opset >= 13:
        return [ctx.ms(f"{grad_op}_13", ctx.dy, ctx.output(0), axis=ctx.attr_or_default("axis"))]
    return [ctx.ms(grad_op, ctx.dy, ctx.output(0), axis=ctx.attr_or_default("axis"))]


@gradient("Softmax")
def softmax(ctx: GradientContext):
    return _softmax_family(ctx, "SoftmaxGrad")


@gradient("LogSoftmax")
def log_softmax(ctx: GradientContext):
    return _softmax_family(ctx, "LogSoftmaxGrad")

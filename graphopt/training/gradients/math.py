"""Gradients of matrix products, broadcasting arithmetic and reductions."""
from __future__ import annotations

import numpy as np

from ..registry import GradientContext, gradient


# ---- matrix products ---------------------------------------------------------------------
@gradient("MatMul")
def matmul(ctx: GradientContext):
    a, b, dy = ctx.input(0), ctx.input(1), ctx.dy
    rank_a, rank_b = ctx.rank(a), ctx.rank(b)
    if rank_a == 1 or rank_b == 1:
        return _matmul_with_vector(ctx, a, b, dy, rank_a, rank_b)
    grad_a = grad_b = None
    if ctx.needs(0):
        grad_a = ctx.ms("FusedMatMul", dy, b, transB=1)  # dY @ B^T, batch dims of Y
        if rank_b > 2:  # B's batch dims may have stretched A: sum them away
            grad_a = ctx.sum_to(grad_a, a, _batched(ctx.shape(ctx.output(0)), ctx.shape(a)))
    if ctx.needs(1):
        if rank_b == 2 and rank_a > 2:
            # a shared weight: fold A's batch dims into rows, one GEMM instead of a sum
            rows_a = ctx.op("Flatten", a, axis=rank_a - 1)
            rows_dy = ctx.op("Flatten", dy, axis=rank_a - 1)
            grad_b = ctx.ms("FusedMatMul", rows_a, rows_dy, transA=1)
        else:
            grad_b = ctx.ms("FusedMatMul", a, dy, transA=1)  # A^T @ dY
            if rank_a > 2 or rank_b > 2:
                grad_b = ctx.sum_to(grad_b, b, _batched(ctx.shape(ctx.output(0)), ctx.shape(b)))
    return [grad_a, grad_b]


def _batched(y_shape, operand_shape):
    """Shape of an operand's full gradient: Y's batch dims, the operand's matrix dims."""
    if y_shape is None or operand_shape is None:
        return None
    return list(y_shape[:-2]) + list(operand_shape[-2:])


def _matmul_with_vector(ctx: GradientContext, a, b, dy, rank_a, rank_b):
    """numpy.matmul promotes a 1-D operand to a matrix and drops that dim from Y again."""
    if rank_a == 1 and rank_b == 1:  # dot product, dY is a scalar
        return [ctx.op("Mul", dy, b), ctx.op("Mul", dy, a)]
    if rank_a == 1:  # a[K] @ B[..., K, N] = Y[..., N]
        column = ctx.op("MatMul", b, ctx.unsqueeze(dy, [-1]))  # [..., K, 1]
        grad_a = ctx.squeeze(column, [-1])
        if rank_b > 2:
            grad_a = ctx.reduce_sum(grad_a, list(range(rank_b - 2)), keepdims=False)
        grad_b = ctx.op("Mul", ctx.unsqueeze(a, [-1]), ctx.unsqueeze(dy, [-2]))  # outer product
        return [grad_a, grad_b]
    # A[..., M, K] @ b[K] = Y[..., M]
    dy_column = ctx.unsqueeze(dy, [-1])  # [..., M, 1]
    grad_a = ctx.op("Mul", dy_column, b)
    grad_b = ctx.reduce_sum(ctx.op("Mul", dy_column, a), list(range(rank_a - 1)), keepdims=False)
    return [grad_a, grad_b]


@gradient("Gemm")
def gemm(ctx: GradientContext):
    """Y = alpha * A' @ B' + beta * C, A' = A^T if transA, B' likewise; Gemm for Gemm, as in
    ONNX Runtime."""
    a, b, c, dy = ctx.input(0), ctx.input(1), ctx.input(2), ctx.dy
    alpha, beta = ctx.attr_or_default("alpha"), ctx.attr_or_default("beta")
    trans_a, trans_b = ctx.attr_or_default("transA"), ctx.attr_or_default("transB")
    grads = [None, None, None]
    if ctx.needs(0):
        if trans_a:  # dA = (dY @ B'^T)^T = B' @ dY^T
            grads[0] = ctx.op("Gemm", b, dy, transA=trans_b, transB=1, alpha=alpha)
        else:  # dA = dY @ B'^T
            grads[0] = ctx.op("Gemm", dy, b, transB=1 - trans_b, alpha=alpha)
    if ctx.needs(1):
        if trans_b:  # dB = (A'^T @ dY)^T = dY^T @ A'
            grads[1] = ctx.op("Gemm", dy, a, transA=1, transB=trans_a, alpha=alpha)
        else:  # dB = A'^T @ dY
            grads[1] = ctx.op("Gemm", a, dy, transA=1 - trans_a, alpha=alpha)
    if c and ctx.needs(2):
        grad_c = dy if beta == 1.0 else ctx.op("Mul", dy, ctx.scalar(beta, c))
        grads[2] = ctx.sum_to(grad_c, c, ctx.shape(ctx.output(0)))
    return grads


# ---- broadcasting arithmetic ---------------------------------------------------------------
def _to_input(ctx: GradientContext, i: int, grad: str) -> str:
    """A gradient shaped like the (broadcast) output, summed back to input ``i``'s shape."""
    return ctx.sum_to(grad, ctx.input(i), ctx.shape(ctx.output(0)))


@gradient("Add")
def add(ctx: GradientContext):
    return [_to_input(ctx, i, ctx.dy) if ctx.needs(i) else None for i in range(2)]


@gradient("Sum")
def sum_(ctx: GradientContext):
    return [_to_input(ctx, i, ctx.dy) if ctx.needs(i) else None for i in range(ctx.num_inputs)]


@gradient("Sub")
def sub(ctx: GradientContext):
    grad_a = _to_input(ctx, 0, ctx.dy) if ctx.needs(0) else None
    grad_b = _to_input(ctx, 1, ctx.op("Neg", ctx.dy)) if ctx.needs(1) else None
    return [grad_a, grad_b]


@gradient("Mul")
def mul(ctx: GradientContext):
    a, b = ctx.input(0), ctx.input(1)
    grad_a = _to_input(ctx, 0, ctx.op("Mul", ctx.dy, b)) if ctx.needs(0) else None
    grad_b = _to_input(ctx, 1, ctx.op("Mul", ctx.dy, a)) if ctx.needs(1) else None
    return [grad_a, grad_b]


@gradient("Div")
def div(ctx: GradientContext):
    b, y = ctx.input(1), ctx.output(0)
    grad_a = _to_input(ctx, 0, ctx.op("Div", ctx.dy, b)) if ctx.needs(0) else None
    grad_b = None
    if ctx.needs(1):  # d(a/b)/db = -a/b^2 = -y/b
        grad_b = _to_input(ctx, 1, ctx.op("Neg", ctx.op("Mul", ctx.dy, ctx.op("Div", y, b))))
    return [grad_a, grad_b]


@gradient("Pow")
def pow_(ctx: GradientContext):
    base, exponent, y = ctx.input(0), ctx.input(1), ctx.output(0)
    grad_base = grad_exponent = None
    if ctx.needs(0):  # d(x^p)/dx = p * x^(p-1); an integer exponent is cast to x's type
        base_type = ctx.dtype(base)
        p = exponent if base_type in (None, ctx.dtype(exponent)) else \
            ctx.op("Cast", exponent, to=base_type)
        power = ctx.op("Pow", base, ctx.op("Sub", p, ctx.scalar(1.0, base)))
        grad_base = _to_input(ctx, 0, ctx.op("Mul", ctx.dy, ctx.op("Mul", p, power)))
    if ctx.needs(1):  # d(x^p)/dp = x^p * ln(x)
        slope = ctx.op("Mul", y, ctx.op("Log", base))
        grad_exponent = _to_input(ctx, 1, ctx.op("Mul", ctx.dy, slope))
    return [grad_base, grad_exponent]


# ---- elementwise math ------------------------------------------------------------------------
@gradient("Neg")
def neg(ctx: GradientContext):
    return [ctx.op("Neg", ctx.dy)]


@gradient("Sqrt")
def sqrt(ctx: GradientContext):  # d sqrt(x) = 1 / (2 sqrt(x))
    y = ctx.output(0)
    return [ctx.op("Div", ctx.op("Mul", ctx.dy, ctx.scalar(0.5, y)), y)]


@gradient("Reciprocal")
def reciprocal(ctx: GradientContext):  # d(1/x) = -1/x^2 = -y*y (dynamo's RMSNorm rsqrt)
    y = ctx.output(0)
    return [ctx.op("Neg", ctx.op("Mul", ctx.dy, ctx.op("Mul", y, y)))]


@gradient("Exp")
def exp(ctx: GradientContext):
    return [ctx.op("Mul", ctx.dy, ctx.output(0))]


@gradient("Log")
def log(ctx: GradientContext):
    return [ctx.op("Div", ctx.dy, ctx.input(0))]


# ---- reductions --------------------------------------------------------------------------------
def _reduced_axes(ctx: GradientContext, axes_attr_until: int) -> list[int] | None:
    """Normalised reduced axes; None when the node reduces nothing (noop_with_empty_axes)."""
    x = ctx.input(0)
    rank = ctx.rank(x)
    if ctx.opset < axes_attr_until:
        axes = ctx.attr("axes")
    else:
        axes = ctx.constant(ctx.input(1), "axes").tolist() if ctx.input(1) else None
    if not axes:
        if ctx.attr_or_default("noop_with_empty_axes"):
            return None
        return list(range(rank))
    return sorted(a + rank if a < 0 else a for a in axes)


def _spread(ctx: GradientContext, axes: list[int], grad: str) -> str:
    """The output gradient put back on every element that was reduced into it."""
    if not ctx.attr_or_default("keepdims"):
        grad = ctx.unsqueeze(grad, axes)
    return ctx.op("Expand", grad, ctx.shape_of(ctx.input(0)))


@gradient("ReduceSum")
def reduce_sum(ctx: GradientContext):
    axes = _reduced_axes(ctx, axes_attr_until=13)
    return [ctx.dy if axes is None else _spread(ctx, axes, ctx.dy)]


@gradient("ReduceMean")
def reduce_mean(ctx: GradientContext):
    axes = _reduced_axes(ctx, axes_attr_until=18)
    if axes is None:
        return [ctx.dy]
    x = ctx.input(0)
    shape = ctx.shape(x)
    dims = [shape[a] for a in axes] if shape is not None else [None]
    if all(isinstance(d, int) for d in dims):
        count = ctx.scalar(float(np.prod(dims)), x)
    else:  # elements per mean, counted at run time
        ratio = ctx.op("Div", ctx.op("Size", x), ctx.op("Size", ctx.output(0)))
        count = ctx.op("Cast", ratio, to=ctx.dtype(x))
    return [_spread(ctx, axes, ctx.op("Div", ctx.dy, count))]

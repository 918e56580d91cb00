"""GEMM-class kernels: MatMul, Gemm, com.microsoft FusedMatMul (all through executor.gemm)."""

from __future__ import annotations

import math

import numpy as np

from graphopt.tensor_types import fused_matmul_permutation

from .. import gemm
from ..registry import MS_DOMAIN, kernel
from ._util import broadcast_shape, compute_dtype


@kernel("MatMul", gemm=True)
def matmul(ctx, node, a, b):
    return gemm.matmul(ctx, a, b)


@kernel("Gemm", gemm=True)
def gemm_op(ctx, node, a, b, c=None):
    if node.attr("transA"):
        a = a.T
    if node.attr("transB"):
        b = b.T
    y = gemm.matmul(ctx, a, b)
    alpha, beta = node.attr("alpha"), node.attr("beta")
    if alpha != 1.0:
        y = y * y.dtype.type(alpha)
    if c is not None and beta != 0.0:
        y = y + (c if beta == 1.0 else c * c.dtype.type(beta))
    return y.astype(a.dtype, copy=False)


def fused_matmul_operand(x, trans_batch: int, trans: int):
    """The operand as FusedMatMul multiplies it (the axes from graphopt's type
    service, the one statement of the flags); flags on a rank-1 operand are ignored."""
    if x.ndim < 2:
        return x
    axes = fused_matmul_permutation(x.ndim, bool(trans_batch), bool(trans))
    return x if axes == list(range(x.ndim)) else x.transpose(axes)


@kernel("FusedMatMul", domain=MS_DOMAIN, gemm=True)
def fused_matmul(ctx, node, a, b):
    a = fused_matmul_operand(a, node.attr("transBatchA"), node.attr("transA"))
    b = fused_matmul_operand(b, node.attr("transBatchB"), node.attr("transB"))
    alpha = node.attr("alpha")
    if alpha != 1.0 and a.dtype == b.dtype and a.dtype in _SCALED_INPUT_DTYPES:
        # alpha on the smaller operand when it is smaller than the product: attention's
        # 1/sqrt(d) then costs a pass over K (B*d*S) instead of one over the scores
        # (B*H*S*S). Exact for a power-of-two alpha, else within an ulp of alpha*(a@b).
        # Not for float16: scaling an FP16 input can make denormals the product never had.
        smaller = a if a.size <= b.size else b
        if smaller.size < _product_size(a, b):
            scaled = smaller * smaller.dtype.type(alpha)
            a, b = (scaled, b) if smaller is a else (a, scaled)
            alpha = 1.0
    y = gemm.matmul(ctx, a, b)
    if alpha != 1.0:
        y *= y.dtype.type(alpha)
    return y


_SCALED_INPUT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def _product_size(a, b) -> int:
    if a.ndim < 2 or b.ndim < 2:
        return 0  # a vector product: as small as its operands, scale the result
    batch = broadcast_shape(a.shape[:-2], b.shape[:-2])
    return math.prod(batch) * a.shape[-2] * b.shape[-1]


@kernel("Einsum", since=12)
def einsum(ctx, node, *xs):
    # Not routed through the GEMM entry point: contractions of arbitrary shape; graphs
    # that matter for the FP16 policy use MatMul/FusedMatMul.
    ct = compute_dtype(xs[0].dtype)
    if ct == xs[0].dtype:
        return ctx.xp.einsum(node.attrs["equation"], *xs)
    result = ctx.xp.einsum(node.attrs["equation"], *(x.astype(ct) for x in xs))
    return result.astype(xs[0].dtype)

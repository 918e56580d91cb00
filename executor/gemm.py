"""The single GEMM entry point. Every GEMM-class kernel (MatMul, Gemm, FusedMatMul, the
im2col products of Conv/ConvTranspose, ConvGrad's dX and dW) multiplies through here so
that the FP16 numerics policy (executor/numerics.py) sees every product."""

from __future__ import annotations

GEMM_OPS = ("gemm", "conv_fwd", "conv_bwd_data", "conv_bwd_weights")


def matmul(ctx, a, b, op: str = "gemm"):
    """``a @ b`` with numpy matmul broadcasting; delegated to ``ctx.numerics`` when set."""
    if ctx.numerics is not None:
        return ctx.numerics.matmul(a, b, op=op)
    if a.ndim > 2 and b.ndim == 2 and a.flags.c_contiguous:
        # One large GEMM instead of one per leading index: BLAS threads far better.
        return ctx.xp.matmul(a.reshape(-1, a.shape[-1]), b).reshape(a.shape[:-1] + (b.shape[1],))
    return ctx.xp.matmul(a, b)

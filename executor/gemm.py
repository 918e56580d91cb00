"""The single GEMM entry point. Every GEMM-class kernel (MatMul, Gemm, FusedMatMul, the
im2col products of Conv/ConvTranspose, ConvGrad's dX and dW) multiplies through here so
that the FP16 numerics policy (executor/numerics/) sees every product."""

from __future__ import annotations

import numpy as np

from . import blas_threads as _blas_threads

GEMM_OPS = ("gemm", "conv_fwd", "conv_bwd_data", "conv_bwd_weights")


def matmul(ctx, a, b, op: str = "gemm"):
    """``a @ b`` with numpy matmul broadcasting; delegated to ``ctx.numerics`` when set.

    A numerics object that declares ``fp16_only`` (the project's own ``Numerics``: it hands
    every other dtype straight to ``xp.matmul``) is skipped for non-FP16 products, so they
    take the layouts below too; any other object sees every product."""
    numerics = ctx.numerics
    if numerics is not None and not (
            getattr(numerics, "fp16_only", False)
            and (a.dtype != np.float16 or b.dtype != np.float16)):
        ctx.blas.restore()  # the policy's own products see BLAS's own thread count
        return numerics.matmul(a, b, op=op)
    # a spare is looked for only while the session keeps some (large arrays: host_memory)
    return plain_matmul(ctx.xp, a, b, ctx.blas, ctx.large_out if ctx.spares else None)


def _merged(x, first: int):
    """``x`` with axes ``first`` and ``first + 1`` merged into one, as a view, or None when
    the strides do not allow it."""
    if x.strides[first] != x.shape[first + 1] * x.strides[first + 1]:
        return None
    return x.reshape(x.shape[:first] + (-1,) + x.shape[first + 2:])


def _product_as(xp, a, b, blas, spare, shape):
    """``a @ b`` (the GEMM BLAS is handed) returned as ``shape``, written into a spare array
    of ``shape`` where ``spare`` has one."""
    out = None if spare is None else spare(shape, a.dtype)
    product_shape = a.shape[:-1] + (b.shape[-1],)
    y = _blas_threads.matmul(xp, a, b, blas, None if out is None else out.reshape(product_shape))
    return y.reshape(shape) if out is None else out


def plain_matmul(xp, a, b, blas: _blas_threads.BlasThreads | None = None, large_out=None):
    """``xp.matmul(a, b)`` done as few, large GEMMs as the operands' layouts allow: BLAS
    threads and blocks far better on one (H*M, K) x (K, N) product than on H small ones.
    ``blas``: the running session's BLAS thread count (see blas_threads.matmul).
    ``large_out(shape, dtype)``: a spare array for a large result, or None
    (KernelContext.large_out); the result is laid out as in an array of its own."""
    spare = large_out if a.dtype == b.dtype else None
    if a.ndim > 2 and b.ndim == 2 and a.flags.c_contiguous:
        # One large GEMM instead of one per leading index.
        return _product_as(xp, a.reshape(-1, a.shape[-1]), b, blas, spare,
                           a.shape[:-1] + (b.shape[1],))
    if (a.ndim >= 3 and b.ndim == a.ndim and b.shape[-3] == 1 and a.shape[-3] > 1
            and b.shape[:-3] == a.shape[:-3]):
        # b shared across axis -3 (multi-query attention: one K/V head for every query
        # head): fold that axis into a's rows, one GEMM per leading index.
        heads, rows = a.shape[-3], a.shape[-2]
        n = b.shape[-1]
        b3 = b.reshape(b.shape[:-3] + b.shape[-2:])
        folded = _merged(a, a.ndim - 3)  # (..., H*M, K) in place
        if folded is not None:
            return _product_as(xp, folded, b3, blas, spare, a.shape[:-1] + (n,))
        # (..., M, H, K): a row-major view or one copy; the result is then laid out
        # (..., M, H, N) and returned as the (..., H, M, N) view of it, which is the layout
        # a following transpose back to (..., M, H, N) wants
        swapped = a.swapaxes(-3, -2)
        folded = _merged(swapped, a.ndim - 3)
        if folded is None:
            folded = xp.ascontiguousarray(swapped).reshape(
                a.shape[:-3] + (rows * heads, a.shape[-1]))
        return _product_as(xp, folded, b3, blas, spare,
                           a.shape[:-3] + (rows, heads, n)).swapaxes(-3, -2)
    out = None
    if spare is not None and a.ndim >= 2 and b.ndim >= 2:
        try:
            batch = np.broadcast_shapes(a.shape[:-2], b.shape[:-2])
        except ValueError:  # matmul says what is wrong with the shapes
            batch = None
        if batch is not None and a.shape[-1] == b.shape[-2]:
            out = spare(batch + (a.shape[-2], b.shape[-1]), a.dtype)
    return _blas_threads.matmul(xp, a, b, blas, out)

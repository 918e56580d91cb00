"""The FP16 GEMM implementations on NumPy.

Accumulation precision, decided once for all three: products are accumulated in float32
and rounded to FP16 once at the end (round-to-nearest-even). That is what MI200 MFMA FP16
("HPA": high-precision accumulate) and the BF16 alternate do, and what cuBLAS does for
``cupy.matmul`` on FP16. NumPy's own float16 matmul would be a slow non-BLAS loop; the
float32 route uses BLAS sgemm and is exact for the products (FP16 x FP16 and BF16 x BF16
products fit in float32's 24-bit significand), so only the summation order differs from a
GPU.

Each function returns ``(result, output_subnormals_before_flush)``; the second value is
only computed when ``count_output`` is true (otherwise None) and feeds the diagnostics.
"""

from __future__ import annotations

import numpy as np

from .fp16_bits import count_subnormals, flush_subnormals, fp16_as_bf16_float32


def _fp32_matmul_to_fp16(a32: np.ndarray, b32: np.ndarray) -> np.ndarray:
    return np.matmul(a32, b32).astype(np.float16)


def original_native(a, b, count_output=False):
    """Plain FP16 GEMM that keeps subnormals (NumPy, NVIDIA GPUs)."""
    out = _fp32_matmul_to_fp16(a.astype(np.float32), b.astype(np.float32))
    return out, (count_subnormals(out) if count_output else None)


def original_mi200(a, b, count_output=False):
    """Emulated MI200 FP16 MFMA: flush inputs -> float32 matmul -> FP16 -> flush outputs."""
    a32 = flush_subnormals(a).astype(np.float32)
    b32 = flush_subnormals(b).astype(np.float32)
    out = _fp32_matmul_to_fp16(a32, b32)
    before_flush = count_subnormals(out) if count_output else None
    return flush_subnormals(out), before_flush


def alternate(a, b, rounding, count_output=False):
    """rocBLAS/MIOpen alternate: FP16 -> BF16 (truncate or RNZ), float32 accumulate, -> FP16.

    FP16 subnormals become normal BF16 values, and subnormal FP16 outputs are kept.
    """
    out = _fp32_matmul_to_fp16(fp16_as_bf16_float32(a, rounding), fp16_as_bf16_float32(b, rounding))
    return out, (count_subnormals(out) if count_output else None)

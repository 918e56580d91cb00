"""The FP16 GEMM implementations on CuPy (CUDA or ROCm), same interface as ``cpu_gemm``.

* alternate: one fused elementwise kernel per input turns FP16 into BF16 bit patterns
  (uint16 buffers; truncation or RNZ decided per call, computed in registers, no float32
  temporaries), then cuBLAS/hipBLAS ``gemmEx`` (batched: ``gemmStridedBatchedEx``) on BF16
  tensor cores with float32 compute, writing FP16 directly. Not every BLAS accepts
  BF16 inputs with an FP16 output (rocBLAS' gemm_ex table has only BF16->BF16 and
  BF16->F32); the first call finds out, and if refused we write float32 and cast once,
  which is the same single float32->FP16 rounding.
* original under emulated MI200: one fused flush kernel per input, ``cupy.matmul``
  (FP16 in/out, float32 compute), one fused flush on the output.
* original, native: ``cupy.matmul``.

Row-major trick: cuBLAS is column-major, and a row-major (m, k) buffer is a column-major
(k, m) matrix, so C = A @ B is computed as C^T = B^T @ A^T: pass B first, A second,
dimensions (n, m, k) and leading dimensions (n, k, n). This is what CuPy's own
``tensordot_core`` does.
"""

from __future__ import annotations

import logging
import math

import numpy as np

from .policy import RNZ, TRUNCATE

log = logging.getLogger(__name__)

CUDA_R_16F = 2
CUDA_R_32F = 0
CUDA_R_16BF = 14
CUBLAS_COMPUTE_32F = 68
CUBLAS_OP_N = 0
CUBLAS_POINTER_MODE_HOST = 0

_TO_BF16_BODY = r"""
    unsigned int u = __float_as_uint((float)x);
    bool special = (u & 0x7f800000u) == 0x7f800000u;   // Inf or NaN: never rounded
    unsigned int r = (rnz && !special) ? u + 0x7fffu : u;  // RNZ: a tie (0x8000) never carries
    unsigned short hi = (unsigned short)(r >> 16);
    if (special && (u & 0xffffu)) hi |= 1;              // keep NaN a NaN
    y = hi;
"""

_FLUSH_BODY = "y = (x & 0x7C00) ? x : (unsigned short)(x & 0x8000);"

# |bits| - 1 as unsigned: zero wraps high, subnormals 0x0001..0x03FF land below 0x03FF.
_SUBNORMAL_TEST = "(((unsigned int)((x & 0x7FFF) - 1)) < 0x3FFu ? 1 : 0)"


class CupyFp16Gemm:
    """FP16 GEMM implementations for one CuPy module (kernels compiled lazily by CuPy)."""

    def __init__(self, cupy):
        from cupy_backends.cuda.libs import cublas  # noqa: PLC0415 - only with CuPy

        self.cp = cupy
        self.cublas = cublas
        self.is_hip = bool(cupy.cuda.runtime.is_hip)
        # hipBLAS (through CuPy's legacy gemmEx path) takes the compute type as a data type.
        self.compute_type = CUDA_R_32F if self.is_hip else CUBLAS_COMPUTE_32F
        self.algo = cublas.CUBLAS_GEMM_DEFAULT
        self.fp16_output_supported: bool | None = None  # learnt on the first alternate call
        self._to_bf16 = cupy.ElementwiseKernel(
            "float16 x, int32 rnz", "uint16 y", _TO_BF16_BODY, "graphopt_fp16_to_bf16_bits"
        )
        self._flush = cupy.ElementwiseKernel(
            "uint16 x", "uint16 y", _FLUSH_BODY, "graphopt_flush_fp16_subnormals"
        )
        self._count = cupy.ReductionKernel(
            "uint16 x", "int64 y", _SUBNORMAL_TEST, "a + b", "y = a", "0",
            "graphopt_count_fp16_subnormals",
        )

    # -- elementwise building blocks -----------------------------------------------------

    def count_subnormals(self, a) -> int:
        return int(self._count(a.view(self.cp.uint16)))

    def flush_subnormals(self, a):
        return self._flush(a.view(self.cp.uint16)).view(self.cp.float16)

    def fp16_to_bf16_bits(self, a, rounding: str = TRUNCATE):
        if rounding not in (TRUNCATE, RNZ):
            raise ValueError(f"rounding must be 'truncate' or 'rnz', got {rounding!r}")
        return self._to_bf16(a, np.int32(rounding == RNZ))

    # -- the three implementations -------------------------------------------------------

    def original_native(self, a, b, count_output=False):
        out = self.cp.matmul(a, b)
        return out, (self.count_subnormals(out) if count_output else None)

    def original_mi200(self, a, b, count_output=False):
        out = self.cp.matmul(self.flush_subnormals(a), self.flush_subnormals(b))
        before_flush = self.count_subnormals(out) if count_output else None
        return self.flush_subnormals(out), before_flush

    def alternate(self, a, b, rounding, count_output=False):
        out = self.bf16_matmul(self.fp16_to_bf16_bits(a, rounding),
                               self.fp16_to_bf16_bits(b, rounding))
        return out, (self.count_subnormals(out) if count_output else None)

    # -- BF16 GEMM through cuBLAS / hipBLAS -----------------------------------------------

    def bf16_matmul(self, a_bits, b_bits):
        """FP16 ``a @ b`` (matmul broadcasting) of BF16 bit-pattern arrays, float32 compute."""
        cp = self.cp
        a_vector, b_vector = a_bits.ndim == 1, b_bits.ndim == 1
        if a_vector:
            a_bits = a_bits[None, :]
        if b_vector:
            b_bits = b_bits[:, None]
        m, k = a_bits.shape[-2:]
        k_b, n = b_bits.shape[-2:]
        if k != k_b:
            raise ValueError(f"matmul: shapes {a_bits.shape} and {b_bits.shape} do not align")
        batch = np.broadcast_shapes(a_bits.shape[:-2], b_bits.shape[:-2])
        count = math.prod(batch)
        a_bits, stride_a = _batched_operand(cp, a_bits, batch, count, m * k)
        b_bits, stride_b = _batched_operand(cp, b_bits, batch, count, k * n)
        out = self._gemm_with_fp16_output(a_bits, b_bits, batch, count, m, k, n, stride_a, stride_b)
        if a_vector:
            out = out[..., 0, :]
        if b_vector:
            out = out[..., 0]
        return out

    def _gemm_with_fp16_output(self, a_bits, b_bits, batch, count, m, k, n, stride_a, stride_b):
        cp = self.cp
        shape = tuple(batch) + (m, n)
        if min(m, n, count) == 0 or k == 0:  # BLAS rejects empty problems; the sum is 0
            return cp.zeros(shape, dtype=cp.float16)
        if self.fp16_output_supported is not False:
            out = cp.empty(shape, dtype=cp.float16)
            try:
                self._gemm(a_bits, b_bits, out, CUDA_R_16F, count, m, k, n, stride_a, stride_b)
                self.fp16_output_supported = True
                return out
            except self.cublas.CUBLASError as exc:
                if self.fp16_output_supported:  # it worked before: a real error
                    raise
                log.info("BF16 GEMM with FP16 output refused (%s); using float32 output", exc)
                self.fp16_output_supported = False
        out32 = cp.empty(shape, dtype=cp.float32)
        self._gemm(a_bits, b_bits, out32, CUDA_R_32F, count, m, k, n, stride_a, stride_b)
        return out32.astype(cp.float16)

    def _gemm(self, a_bits, b_bits, out, c_type, count, m, k, n, stride_a, stride_b):
        cublas, cp = self.cublas, self.cp
        handle = cp.cuda.device.get_cublas_handle()
        one = np.ones(1, dtype=np.float32)  # alpha/beta: host pointers, float32 compute
        zero = np.zeros(1, dtype=np.float32)
        saved_mode = cublas.getPointerMode(handle)
        cublas.setPointerMode(handle, CUBLAS_POINTER_MODE_HOST)
        try:
            common = (handle, CUBLAS_OP_N, CUBLAS_OP_N, n, m, k, one.ctypes.data)
            if count == 1:
                cublas.gemmEx(
                    *common,
                    b_bits.data.ptr, CUDA_R_16BF, n,
                    a_bits.data.ptr, CUDA_R_16BF, k,
                    zero.ctypes.data, out.data.ptr, c_type, n,
                    self.compute_type, self.algo,
                )
            elif hasattr(cublas, "gemmStridedBatchedEx"):
                cublas.gemmStridedBatchedEx(
                    *common,
                    b_bits.data.ptr, CUDA_R_16BF, n, stride_b,
                    a_bits.data.ptr, CUDA_R_16BF, k, stride_a,
                    zero.ctypes.data, out.data.ptr, c_type, n, m * n,
                    count, self.compute_type, self.algo,
                )
            else:  # older CuPy: one gemmEx per batch entry
                for i in range(count):
                    cublas.gemmEx(
                        *common,
                        b_bits.data.ptr + 2 * i * stride_b, CUDA_R_16BF, n,
                        a_bits.data.ptr + 2 * i * stride_a, CUDA_R_16BF, k,
                        zero.ctypes.data, out.data.ptr + out.itemsize * i * m * n, c_type, n,
                        self.compute_type, self.algo,
                    )
        finally:
            cublas.setPointerMode(handle, saved_mode)


def _batched_operand(cp, bits, batch, count, matrix_size):
    """(C-contiguous operand, batch stride in elements) for a strided-batched GEMM.

    An operand with the full batch keeps its layout; one shared by the whole batch gets
    stride 0 (no copy); a partially broadcast one is materialised.
    """
    own = math.prod(bits.shape[:-2])
    if own == count:
        return cp.ascontiguousarray(bits), matrix_size
    if own == 1:
        return cp.ascontiguousarray(bits.reshape(bits.shape[-2:])), 0
    full = cp.broadcast_to(bits, tuple(batch) + bits.shape[-2:])
    return cp.ascontiguousarray(full), matrix_size

"""The FP16 GEMM implementations on CuPy (CUDA or ROCm), same interface as ``cpu_gemm``.

Every FP16 product is one BLAS call on FP16 data with float32 compute, whatever the rank:
``cupy.matmul`` is never used for FP16, because for more than two dimensions it upcasts both
operands to float32 and runs SGEMM (CuPy ``_routines_linalg.pyx``), which neither flushes
like MI200 nor runs on tensor cores.

* NVIDIA: cuBLAS ``gemmEx`` / ``gemmStridedBatchedEx`` through CuPy, FP16 in and out,
  ``CUBLAS_COMPUTE_32F`` (tensor cores).
* AMD: rocBLAS ``rocblas_gemm_ex`` / ``rocblas_gemm_strided_batched_ex`` through ctypes on
  librocblas (CuPy's hipBLAS handle is a rocblas_handle: hipBLAS's rocBLAS backend creates it
  with ``rocblas_create_handle``), on CuPy's current stream, FP16 in and out, f32 compute,
  ``flags = rocblas_gemm_flags_fp16_alt_impl`` (0x4, plus ``_rnz`` 0x10) exactly when the
  policy says alternate. On gfx90a that is rocBLAS's own BF16 alternate kernel; elsewhere the
  flag means nothing to rocBLAS, so the alternate is emulated. BF16 never goes through
  CuPy's ``gemmEx`` on HIP: CuPy's HIP type table knows types 0-9 only and throws a C++
  exception that aborts the process.

Emulation (NVIDIA, and AMD GPUs other than gfx90a):
* alternate: one fused elementwise kernel per operand turns FP16 bits into BF16 bits
  (integer operations only, so NaN payloads survive; truncation or RNZ), in the operand's
  own memory layout; then a BF16 GEMM with float32 output (neither cuBLAS nor rocBLAS offers
  BF16 in / FP16 out) and one cast, the single float32->FP16 rounding.
* original under emulated MI200: one fused flush kernel per operand, the FP16 GEMM, one flush
  of the output.

Operand handling (``plan_gemm``): transposed views are passed with the BLAS op flag instead
of being copied; broadcast batch operands (MQA's shared K/V, a weight shared by the batch)
get batch stride 0 instead of being materialised; an N-D @ 2-D product whose rows are
contiguous is folded into one GEMM. Row-major trick: cuBLAS is column-major, so C = A @ B
is computed as C^T = B^T @ A^T (B first), as CuPy's ``tensordot_core`` does.
"""

from __future__ import annotations

import ctypes
import itertools
import logging
import math
from dataclasses import dataclass

import numpy as np

from .policy import RNZ, TRUNCATE

log = logging.getLogger(__name__)

# cudaDataType / cublasComputeType_t / cublasOperation_t (cuBLAS headers, CuPy's constants)
CUDA_R_16F = 2
CUDA_R_32F = 0
CUDA_R_16BF = 14
CUBLAS_COMPUTE_32F = 68
CUBLAS_OP_N = 0
CUBLAS_OP_T = 1
CUBLAS_POINTER_MODE_HOST = 0

# rocBLAS (library/include/internal/rocblas-types.h)
ROCBLAS_OPERATION = {CUBLAS_OP_N: 111, CUBLAS_OP_T: 112}  # rocblas_operation_none/transpose
ROCBLAS_DATATYPE = {CUDA_R_16F: 150, CUDA_R_32F: 151, CUDA_R_16BF: 168}  # f16_r f32_r bf16_r
ROCBLAS_GEMM_ALGO_STANDARD = 0
ROCBLAS_GEMM_FLAGS_FP16_ALT_IMPL = 0x4
ROCBLAS_GEMM_FLAGS_FP16_ALT_IMPL_RNZ = 0x10
ROCBLAS_LIBRARIES = ("librocblas.so", "librocblas.so.5", "librocblas.so.4", "librocblas.so.0")

# FP16 bits -> BF16 bits with integer operations only (no float conversion that could
# canonicalise a NaN): rebuild the float32 bits u of the FP16 value exactly (subnormals
# normalised with a count of leading zeros), then truncate or round (RNZ) to the top 16.
_TO_BF16_BODY = r"""
    unsigned int h = x;
    unsigned int sign = (h & 0x8000u) << 16;
    unsigned int exponent = (h >> 10) & 0x1fu;
    unsigned int mantissa = h & 0x3ffu;
    unsigned int u;
    if (exponent == 0x1fu) {
        u = sign | 0x7f800000u | (mantissa << 13);            // Inf / NaN, payload kept
    } else if (exponent != 0u) {
        u = sign | ((exponent + 112u) << 23) | (mantissa << 13);
    } else if (mantissa == 0u) {
        u = sign;                                             // signed zero
    } else {
        unsigned int shift = (unsigned int)__clz((int)mantissa) - 21u;  // lead 1 -> bit 10
        u = sign | ((113u - shift) << 23) | (((mantissa << shift) & 0x3ffu) << 13);
    }
    bool special = (u & 0x7f800000u) == 0x7f800000u;   // Inf or NaN: never rounded
    unsigned int r = (rnz && !special) ? u + 0x7fffu : u;  // RNZ: a tie (0x8000) never carries
    unsigned short hi = (unsigned short)(r >> 16);
    if (special && (u & 0xffffu)) hi |= 1;              // keep NaN a NaN
    y = hi;
"""

_FLUSH_BODY = "y = (x & 0x7C00) ? x : (unsigned short)(x & 0x8000);"

# |bits| - 1 as unsigned: zero wraps high, subnormals 0x0001..0x03FF land below 0x03FF.
_SUBNORMAL_TEST = "(((unsigned int)((x & 0x7FFF) - 1)) < 0x3FFu ? 1 : 0)"


# -- planning: pure shape/stride arithmetic, testable without a GPU -----------------------------
@dataclass(frozen=True)
class GemmCall:
    """One (strided-batched) column-major BLAS call, pointers as byte offsets from the
    operands' data pointers: C^T (n x m) = op(B-buffer) @ op(A-buffer)."""

    op_b: int
    op_a: int
    m: int  # BLAS m (our n)
    n: int  # BLAS n (our m)
    k: int
    b_offset: int
    ldb: int
    stride_b: int  # elements
    a_offset: int
    lda: int
    stride_a: int
    c_offset: int
    ldc: int
    stride_c: int
    count: int


def matrix_layout(shape, strides, itemsize):
    """(op, ld) reading the last two axes without a copy, or None.

    Row-major storage (element (i, j) at i*ld + j) is the column-major transpose: op N.
    Column-major storage (i + j*ld), e.g. a transposed view: op T.
    """
    rows, cols = shape
    sr, sc = strides
    if sr % itemsize or sc % itemsize:
        return None
    sr, sc = sr // itemsize, sc // itemsize
    if (cols == 1 or sc == 1) and (rows == 1 or sr >= max(cols, 1)):
        return CUBLAS_OP_N, max(cols, 1) if rows == 1 else sr
    if (rows == 1 or sr == 1) and (cols == 1 or sc >= max(rows, 1)):
        return CUBLAS_OP_T, max(rows, 1) if cols == 1 else sc
    return None


def _usable(x) -> bool:
    if matrix_layout(x.shape[-2:], x.strides[-2:], x.itemsize) is None:
        return False
    return all(s >= 0 and s % x.itemsize == 0 for s in x.strides[:-2])


def prepare_operand(xp, x):
    """``x`` itself when a BLAS call can read it in place, else a C-contiguous copy."""
    return x if _usable(x) else xp.ascontiguousarray(x)


def plan_gemm(a, b, batch):
    """GemmCalls computing ``a @ b`` into a C-contiguous (batch..., m, n) output.

    ``a``: (..., m, k) and ``b``: (..., k, n), already broadcast to ``batch`` with
    ``broadcast_to`` (stride 0 on broadcast dimensions) and readable in place.
    """
    m, k = a.shape[-2:]
    n = b.shape[-1]
    item_a, item_b = a.itemsize, b.itemsize
    op_a, lda = matrix_layout(a.shape[-2:], a.strides[-2:], item_a)
    op_b, ldb = matrix_layout(b.shape[-2:], b.strides[-2:], item_b)
    sa = [s // item_a for s in a.strides[:-2]]
    sb = [s // item_b for s in b.strides[:-2]]
    dims = list(batch)
    sc = [math.prod(dims[i + 1:]) * m * n for i in range(len(dims))]

    # N-D @ shared 2-D with row-major rows of uniform pitch: fold the batch into M.
    if dims and op_a == CUBLAS_OP_N and all(s == 0 for s in sb) and _folds(dims, sa, m * lda):
        return [GemmCall(op_b, op_a, n, m * math.prod(dims), k, 0, ldb, 0, 0, lda, 0, 0, n,
                         0, 1)]

    # drop size-1 dims, merge neighbours whose strides chain for all three operands
    merged = []
    for size, s_a, s_b, s_c in zip(dims, sa, sb, sc, strict=True):
        if size == 1:
            continue
        if merged:
            p_size, p_a, p_b, p_c = merged[-1]
            if p_a == s_a * size and p_b == s_b * size and p_c == s_c * size:
                merged[-1] = (p_size * size, s_a, s_b, s_c)
                continue
        merged.append((size, s_a, s_b, s_c))
    if not merged:
        merged = [(1, 0, 0, m * n)]
    *outer, (count, stride_a, stride_b, stride_c) = merged
    calls = []
    for index in itertools.product(*(range(size) for size, *_ in outer)):
        off_a = sum(i * s for i, (_, s, _, _) in zip(index, outer, strict=True))
        off_b = sum(i * s for i, (_, _, s, _) in zip(index, outer, strict=True))
        off_c = sum(i * s for i, (_, _, _, s) in zip(index, outer, strict=True))
        calls.append(GemmCall(op_b, op_a, n, m, k, off_b * item_b, ldb, stride_b,
                              off_a * item_a, lda, stride_a, off_c, n, stride_c, count))
    return calls


def blas_matmul(xp, a, b, out_dtype, run):
    """``a @ b`` with matmul broadcasting through ``run(call, a, b, out)`` per GemmCall
    (``a``/``b`` as the calls read them, ``out`` a new C-contiguous array)."""
    a_vector, b_vector = a.ndim == 1, b.ndim == 1
    if a_vector:
        a = a[None, :]
    if b_vector:
        b = b[:, None]
    m, k = a.shape[-2:]
    k_b, n = b.shape[-2:]
    if k != k_b:
        raise ValueError(f"matmul: shapes {a.shape} and {b.shape} do not align")
    batch = tuple(np.broadcast_shapes(a.shape[:-2], b.shape[:-2]))
    shape = batch + (m, n)
    if min(m, n, k) == 0 or math.prod(batch) == 0:  # BLAS rejects empty problems
        out = xp.zeros(shape, dtype=out_dtype)
    else:
        a = xp.broadcast_to(prepare_operand(xp, a), batch + (m, k))
        b = xp.broadcast_to(prepare_operand(xp, b), batch + (k, n))
        out = xp.empty(shape, dtype=out_dtype)
        for call in plan_gemm(a, b, batch):
            run(call, a, b, out)
    if a_vector:
        out = out[..., 0, :]
    if b_vector:
        out = out[..., 0]
    return out


def _folds(dims, strides, rows_span) -> bool:
    """The batch dims of a row-major operand step through consecutive row blocks."""
    expected = rows_span
    for size, stride in zip(reversed(dims), reversed(strides), strict=True):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


# -- rocBLAS through ctypes ------------------------------------------------------------------------
class RocblasGemm:
    """``rocblas_gemm_ex`` / ``rocblas_gemm_strided_batched_ex`` (32-bit rocblas_int API)."""

    def __init__(self, library=None):
        self.lib = library if library is not None else _load_rocblas()
        i32, u32, ptr, i64 = ctypes.c_int32, ctypes.c_uint32, ctypes.c_void_p, ctypes.c_int64
        self.gemm_ex = self.lib.rocblas_gemm_ex
        self.gemm_ex.restype = ctypes.c_int
        self.gemm_ex.argtypes = [ptr, i32, i32, i32, i32, i32, ptr,
                                 ptr, i32, i32, ptr, i32, i32, ptr,
                                 ptr, i32, i32, ptr, i32, i32,
                                 i32, i32, i32, u32]
        self.gemm_strided_ex = self.lib.rocblas_gemm_strided_batched_ex
        self.gemm_strided_ex.restype = ctypes.c_int
        self.gemm_strided_ex.argtypes = [ptr, i32, i32, i32, i32, i32, ptr,
                                         ptr, i32, i32, i64, ptr, i32, i32, i64, ptr,
                                         ptr, i32, i32, i64, ptr, i32, i32, i64,
                                         i32, i32, i32, i32, u32]
        self.set_stream = self.lib.rocblas_set_stream
        self.set_stream.restype = ctypes.c_int
        self.set_stream.argtypes = [ptr, ptr]
        self.set_pointer_mode = self.lib.rocblas_set_pointer_mode
        self.set_pointer_mode.restype = ctypes.c_int
        self.set_pointer_mode.argtypes = [ptr, ctypes.c_int]
        self.get_pointer_mode = self.lib.rocblas_get_pointer_mode
        self.get_pointer_mode.restype = ctypes.c_int
        self.get_pointer_mode.argtypes = [ptr, ctypes.POINTER(ctypes.c_int)]

    def run(self, handle, stream, call: GemmCall, b_ptr, a_ptr, c_ptr, in_type, out_type,
            flags: int) -> None:
        _check(self.set_stream(handle, stream), "rocblas_set_stream")
        saved = ctypes.c_int(0)
        _check(self.get_pointer_mode(handle, ctypes.byref(saved)), "rocblas_get_pointer_mode")
        _check(self.set_pointer_mode(handle, 0), "rocblas_set_pointer_mode")  # host scalars
        try:
            self._gemm(handle, call, b_ptr, a_ptr, c_ptr, in_type, out_type, flags)
        finally:
            self.set_pointer_mode(handle, saved.value)

    def _gemm(self, handle, call, b_ptr, a_ptr, c_ptr, in_type, out_type, flags):
        one = ctypes.c_float(1.0)
        zero = ctypes.c_float(0.0)
        t_in, t_out = ROCBLAS_DATATYPE[in_type], ROCBLAS_DATATYPE[out_type]
        t_compute = ROCBLAS_DATATYPE[CUDA_R_32F]
        op_b, op_a = ROCBLAS_OPERATION[call.op_b], ROCBLAS_OPERATION[call.op_a]
        alpha, beta = ctypes.byref(one), ctypes.byref(zero)
        if call.count == 1:
            status = self.gemm_ex(handle, op_b, op_a, call.m, call.n, call.k, alpha,
                                  b_ptr, t_in, call.ldb, a_ptr, t_in, call.lda, beta,
                                  c_ptr, t_out, call.ldc, c_ptr, t_out, call.ldc,
                                  t_compute, ROCBLAS_GEMM_ALGO_STANDARD, 0, flags)
            _check(status, "rocblas_gemm_ex")
            return
        status = self.gemm_strided_ex(
            handle, op_b, op_a, call.m, call.n, call.k, alpha,
            b_ptr, t_in, call.ldb, call.stride_b, a_ptr, t_in, call.lda, call.stride_a, beta,
            c_ptr, t_out, call.ldc, call.stride_c, c_ptr, t_out, call.ldc, call.stride_c,
            call.count, t_compute, ROCBLAS_GEMM_ALGO_STANDARD, 0, flags)
        _check(status, "rocblas_gemm_strided_batched_ex")


class RocblasError(RuntimeError):
    pass


def _check(status: int, what: str) -> None:
    if status != 0:
        raise RocblasError(f"{what} returned rocblas_status {status}")


def _load_rocblas():
    errors = []
    for name in ROCBLAS_LIBRARIES:
        try:
            return ctypes.CDLL(name)
        except OSError as exc:
            errors.append(str(exc))
    raise RocblasError("cannot load librocblas (" + "; ".join(errors) + ")")


# -- the implementations -------------------------------------------------------------------------
class WeightGeneration:
    """The weights a trainer feeds, and a count it bumps whenever they may have changed.

    The optimizer updates weights in place (same object, same pointer), so a cache of
    converted weights must not trust an address: it keeps what it converted only while
    ``value`` is unchanged. ``bump(weights)`` starts a generation with the arrays that are
    weights in it (the trainer calls it before each step's run); only those, and views of
    them (``w.T``), are cached: activations' memory is reused at the same address."""

    def __init__(self):
        self.value = 0
        self.weights: tuple = ()

    def bump(self, weights=()) -> None:
        self.value += 1
        self.weights = tuple(weights)


class ConvertedWeights:
    """Conversions of weights (FP16 -> BF16 bits for the emulated alternate, the subnormal
    flush for the emulated MI200 original), each made once per :class:`WeightGeneration`:
    a weight read by several GEMMs of a step is converted once per layout and kind."""

    def __init__(self, generation: WeightGeneration):
        self.generation = generation
        self._value = None
        self._entries: dict = {}
        self.hits = self.misses = 0

    def get(self, x, kind, convert):
        generation = self.generation
        if self._value != generation.value:   # the weights may have changed: forget all
            self._entries.clear()
            self._value = generation.value
        owner = next((w for w in generation.weights if x is w or x.base is w), None)
        if owner is None:
            return convert(x)
        key = (id(owner), _address(x), x.shape, x.strides, kind)
        entry = self._entries.get(key)
        if entry is not None and entry[0] is owner:
            self.hits += 1
            return entry[1]
        self.misses += 1
        converted = convert(x)
        self._entries[key] = (owner, converted)   # holding the owner keeps its id unique
        return converted


def _address(x) -> int:
    data = x.data
    return data.ptr if hasattr(data, "ptr") else x.__array_interface__["data"][0]


class CupyFp16Gemm:
    """FP16 GEMM implementations for one CuPy module (kernels compiled lazily by CuPy).

    ``native_alternate``: the BLAS has the alternate itself (rocBLAS on gfx90a), so the
    alternate is a flag, not an emulation.
    """

    def __init__(self, cupy, native_alternate: bool = False):
        self.cp = cupy
        self.is_hip = bool(cupy.cuda.runtime.is_hip)
        self.native_alternate = bool(native_alternate and self.is_hip)
        self._rocblas = None
        self._cublas = None
        self.weight_cache: ConvertedWeights | None = None   # see Numerics.cache_weights
        self._to_bf16 = cupy.ElementwiseKernel(
            "uint16 x, int32 rnz", "uint16 y", _TO_BF16_BODY, "graphopt_fp16_to_bf16_bits"
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
        return _keep_layout(lambda x: self._flush(x.view(self.cp.uint16)), a).view(
            self.cp.float16)

    def fp16_to_bf16_bits(self, a, rounding: str = TRUNCATE):
        if rounding not in (TRUNCATE, RNZ):
            raise ValueError(f"rounding must be 'truncate' or 'rnz', got {rounding!r}")
        rnz = np.int32(rounding == RNZ)
        return _keep_layout(lambda x: self._to_bf16(x.view(self.cp.uint16), rnz), a)

    # -- the three implementations -------------------------------------------------------

    def original_native(self, a, b, count_output=False):
        out = self.matmul(a, b, CUDA_R_16F, CUDA_R_16F)
        return out, (self.count_subnormals(out) if count_output else None)

    def original_mi200(self, a, b, count_output=False):
        out = self.matmul(self._flushed_operand(a), self._flushed_operand(b),
                          CUDA_R_16F, CUDA_R_16F)
        before_flush = self.count_subnormals(out) if count_output else None
        return self.flush_subnormals(out), before_flush

    def alternate(self, a, b, rounding, count_output=False):
        if self.native_alternate:  # rocBLAS's own alternate kernel (gfx90a)
            flags = ROCBLAS_GEMM_FLAGS_FP16_ALT_IMPL
            if rounding == RNZ:
                flags |= ROCBLAS_GEMM_FLAGS_FP16_ALT_IMPL_RNZ
            out = self.matmul(a, b, CUDA_R_16F, CUDA_R_16F, flags)
        else:
            out = self.matmul(self._bf16_operand(a, rounding), self._bf16_operand(b, rounding),
                              CUDA_R_16BF, CUDA_R_32F)
            out = out.astype(self.cp.float16)
        return out, (self.count_subnormals(out) if count_output else None)

    def cache_weights(self, generation: WeightGeneration) -> bool:
        """Convert the weights of ``generation`` once per generation (False: rocBLAS's own
        alternate converts nothing)."""
        if self.native_alternate:
            return False
        self.weight_cache = ConvertedWeights(generation)
        return True

    def _flushed_operand(self, x):
        if self.weight_cache is None:
            return self.flush_subnormals(x)
        return self.weight_cache.get(x, "flush", self.flush_subnormals)

    def _bf16_operand(self, x, rounding):
        if self.weight_cache is None:
            return self.fp16_to_bf16_bits(x, rounding)
        return self.weight_cache.get(x, rounding,
                                     lambda v: self.fp16_to_bf16_bits(v, rounding))

    # -- one GEMM, any rank ---------------------------------------------------------------

    def matmul(self, a, b, in_type, out_type, flags: int = 0):
        """``a @ b`` (matmul broadcasting) of 2-byte arrays (FP16, or BF16 bits as uint16),
        float32 compute, output FP16 or float32."""
        out_dtype = self.cp.float16 if out_type == CUDA_R_16F else self.cp.float32
        return blas_matmul(
            self.cp, a, b, out_dtype,
            lambda call, a_, b_, out: self._run(call, a_, b_, out, in_type, out_type, flags))

    def _run(self, call, a, b, out, in_type, out_type, flags):
        cp = self.cp
        handle = cp.cuda.device.get_cublas_handle()
        b_ptr = b.data.ptr + call.b_offset
        a_ptr = a.data.ptr + call.a_offset
        c_ptr = out.data.ptr + call.c_offset * out.itemsize
        if self.is_hip:
            if self._rocblas is None:
                self._rocblas = RocblasGemm()
            stream = cp.cuda.get_current_stream().ptr
            self._rocblas.run(handle, stream, call, b_ptr, a_ptr, c_ptr, in_type, out_type,
                              flags)
            return
        if flags:
            raise ValueError("rocBLAS GEMM flags on a CUDA device")
        self._run_cublas(handle, call, b_ptr, a_ptr, c_ptr, in_type, out_type)

    def _run_cublas(self, handle, call, b_ptr, a_ptr, c_ptr, in_type, out_type):
        if self._cublas is None:
            from cupy_backends.cuda.libs import cublas  # noqa: PLC0415 - only with CuPy

            self._cublas = cublas
        cublas = self._cublas
        one = np.ones(1, dtype=np.float32)  # alpha/beta: host pointers, float32 compute
        zero = np.zeros(1, dtype=np.float32)
        saved_mode = cublas.getPointerMode(handle)
        cublas.setPointerMode(handle, CUBLAS_POINTER_MODE_HOST)
        try:
            common = (handle, call.op_b, call.op_a, call.m, call.n, call.k, one.ctypes.data)
            if call.count == 1:
                cublas.gemmEx(
                    *common,
                    b_ptr, in_type, call.ldb,
                    a_ptr, in_type, call.lda,
                    zero.ctypes.data, c_ptr, out_type, call.ldc,
                    CUBLAS_COMPUTE_32F, cublas.CUBLAS_GEMM_DEFAULT,
                )
            else:
                cublas.gemmStridedBatchedEx(
                    *common,
                    b_ptr, in_type, call.ldb, call.stride_b,
                    a_ptr, in_type, call.lda, call.stride_a,
                    zero.ctypes.data, c_ptr, out_type, call.ldc, call.stride_c,
                    call.count, CUBLAS_COMPUTE_32F, cublas.CUBLAS_GEMM_DEFAULT,
                )
        finally:
            cublas.setPointerMode(handle, saved_mode)


def _keep_layout(kernel, x):
    """Apply an elementwise kernel in ``x``'s own memory order: a transposed view is
    converted through its contiguous base (coalesced reads) and handed back transposed,
    so the GEMM reads it with the op flag instead of a copy."""
    if x.ndim >= 2 and not x.flags.c_contiguous:
        swapped = x.swapaxes(-1, -2)
        if swapped.flags.c_contiguous:
            return kernel(swapped).swapaxes(-1, -2)
    return kernel(x)

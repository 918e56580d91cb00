"""The GPU GEMM's BLAS arguments, checked on the CPU.

``blas_matmul`` turns ``a @ b`` into column-major (strided-batched) BLAS calls: op flags for
transposed views, leading dimensions, batch strides (0 for broadcast operands), folding of
N-D @ 2-D, loops over batch dimensions that cannot be merged. Here each call is executed by
a literal NumPy reading of the BLAS contract on the raw buffers, so a wrong flag, ld,
stride or offset gives a wrong product; the FP16 kernels of the device (tests/executor/numerics/
test_gpu.py) then only add the arithmetic. Also: the integer FP16->BF16 kernel body, compiled
as C, against the host conversion for all 65,536 patterns.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess

import numpy as np
import pytest

from graphopt.executor.numerics import fp16_bits
from graphopt.executor.numerics.gpu_gemm import (
    _TO_BF16_BODY,
    CUBLAS_OP_N,
    CUBLAS_OP_T,
    blas_matmul,
    plan_gemm,
    prepare_operand,
)


def _column_major(ptr, rows, cols, ld, dtype):
    """The rows x cols column-major matrix at ``ptr`` with leading dimension ``ld``."""
    item = np.dtype(dtype).itemsize
    span = ((cols - 1) * ld + rows) * item
    buffer = (ctypes.c_char * span).from_address(ptr)
    return np.ndarray((rows, cols), dtype, buffer=buffer, strides=(item, ld * item))


def _run_like_blas(calls_seen):
    def run(call, a, b, out):
        calls_seen.append(call)
        assert call.ldc >= call.m and call.count >= 1
        for i in range(call.count):
            # first BLAS operand: the B buffer, op(.) is m x k
            rows, cols = (call.m, call.k) if call.op_b == CUBLAS_OP_N else (call.k, call.m)
            assert call.ldb >= max(1, rows)
            first = _column_major(b.ctypes.data + call.b_offset + i * call.stride_b * b.itemsize,
                                  rows, cols, call.ldb, b.dtype)
            first = first if call.op_b == CUBLAS_OP_N else first.T
            rows, cols = (call.k, call.n) if call.op_a == CUBLAS_OP_N else (call.n, call.k)
            assert call.lda >= max(1, rows)
            second = _column_major(a.ctypes.data + call.a_offset + i * call.stride_a * a.itemsize,
                                   rows, cols, call.lda, a.dtype)
            second = second if call.op_a == CUBLAS_OP_N else second.T
            c = _column_major(out.ctypes.data + (call.c_offset + i * call.stride_c) * out.itemsize,
                              call.m, call.n, call.ldc, out.dtype)
            c[...] = (first.astype(np.float64) @ second.astype(np.float64)).astype(out.dtype)

    return run


def _operand(rng, shape, kind):
    base = rng.standard_normal(shape).astype(np.float32)
    if kind == "transposed":  # a transposed view of a contiguous array
        return np.ascontiguousarray(base.swapaxes(-1, -2)).swapaxes(-1, -2)
    if kind == "pitched":  # rows of a wider array (ld > cols)
        wide = rng.standard_normal(shape[:-1] + (shape[-1] + 3,)).astype(np.float32)
        return wide[..., : shape[-1]]
    if kind == "strided":  # every other row: no BLAS layout, must be copied
        tall = rng.standard_normal(shape[:-2] + (2 * shape[-2], shape[-1])).astype(np.float32)
        return tall[..., ::2, :]
    return base


CASES = [
    # (a shape, b shape)
    ((5, 7), (7, 3)),
    ((4, 5, 7), (7, 3)),            # N-D @ 2-D: folded into one GEMM when rows are contiguous
    ((2, 4, 5, 7), (2, 4, 7, 3)),   # full batch: one strided-batched call
    ((2, 4, 5, 7), (2, 1, 7, 3)),   # MQA: K/V shared by the heads (stride 0, loop over 2)
    ((2, 1, 5, 7), (1, 4, 7, 3)),   # both broadcast on different dims
    ((5, 7), (3, 7, 4)),            # 2-D @ N-D
    ((1, 5, 7), (3, 7, 4)),
    ((3, 1, 7), (3, 7, 1)),         # degenerate matrices
    ((7,), (7, 3)),                 # vectors
    ((4, 5, 7), (7,)),
    ((2, 0, 7), (7, 3)),            # empty
    ((5, 0), (0, 3)),               # k = 0: zeros
]
KINDS = ["contiguous", "transposed", "pitched", "strided"]


@pytest.mark.parametrize(("a_shape", "b_shape"), CASES)
@pytest.mark.parametrize("a_kind", KINDS)
@pytest.mark.parametrize("b_kind", KINDS)
def test_blas_calls_compute_the_matmul(a_shape, b_shape, a_kind, b_kind):
    rng = np.random.default_rng(0)
    a = _operand(rng, a_shape, a_kind if len(a_shape) > 1 else "contiguous")
    b = _operand(rng, b_shape, b_kind if len(b_shape) > 1 else "contiguous")
    calls = []
    got = blas_matmul(np, a, b, np.float64, _run_like_blas(calls))
    want = np.matmul(a.astype(np.float64), b.astype(np.float64))
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def test_transposed_and_broadcast_operands_are_not_copied():
    rng = np.random.default_rng(1)
    weight = rng.standard_normal((8, 6)).astype(np.float32)
    transposed = weight.T  # (6, 8), a FusedMatMul transB operand
    assert prepare_operand(np, transposed) is transposed
    q = rng.standard_normal((2, 4, 5, 6)).astype(np.float32)
    kv = rng.standard_normal((2, 1, 6, 5)).astype(np.float32)
    batch = (2, 4)
    calls = plan_gemm(np.broadcast_to(q, batch + (5, 6)), np.broadcast_to(kv, batch + (6, 5)),
                      batch)
    assert len(calls) == 2 and all(c.count == 4 and c.stride_b == 0 for c in calls)
    calls = plan_gemm(np.broadcast_to(q, batch + (5, 6)),
                      np.broadcast_to(transposed, batch + (6, 8)), batch)
    assert len(calls) == 1 and calls[0].count == 1 and calls[0].n == 2 * 4 * 5  # folded
    assert calls[0].op_b == CUBLAS_OP_T


def test_integer_bf16_kernel_body_matches_the_host_conversion(tmp_path):
    """The device kernel builds float32 bits from FP16 bits with integers only (NaN
    payloads survive, unlike a float conversion); compiled here as C, all 65,536 patterns."""
    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    source = tmp_path / "bf16.c"
    source.write_text(
        "#include <stdbool.h>\n#define __clz(v) __builtin_clz((unsigned int)(v))\n"
        "void convert(const unsigned short* in, unsigned short* out, int n, int rnz) {\n"
        "  for (int i = 0; i < n; ++i) { unsigned short x = in[i]; unsigned short y;\n"
        f"{_TO_BF16_BODY}\n"
        "  out[i] = y; } }\n")
    library = tmp_path / "bf16.so"
    subprocess.run([cc, "-O1", "-shared", "-fPIC", "-o", str(library), str(source)],
                   check=True, capture_output=True, timeout=120)
    convert = ctypes.CDLL(str(library)).convert
    patterns = np.arange(65536, dtype=np.uint16)
    for rounding, rnz in (("truncate", 0), ("rnz", 1)):
        got = np.empty_like(patterns)
        convert(patterns.ctypes.data_as(ctypes.c_void_p), got.ctypes.data_as(ctypes.c_void_p),
                ctypes.c_int(patterns.size), ctypes.c_int(rnz))
        want = fp16_bits.fp16_to_bf16_bits(patterns.view(np.float16), rounding)
        np.testing.assert_array_equal(got, want, err_msg=rounding)


ROCBLAS_STUB = r"""
#include <stdint.h>
typedef void* rocblas_handle;
int64_t seen[40]; float scalars[2]; int calls = 0; int mode = 7;
int rocblas_set_stream(rocblas_handle h, void* s) { seen[38] = (int64_t)s; return 0; }
int rocblas_get_pointer_mode(rocblas_handle h, int* m) { *m = mode; return 0; }
int rocblas_set_pointer_mode(rocblas_handle h, int m) { mode = m; seen[39] = m; return 0; }
int rocblas_gemm_ex(rocblas_handle h, int ta, int tb, int m, int n, int k, const void* alpha,
    const void* a, int at, int lda, const void* b, int bt, int ldb, const void* beta,
    const void* c, int ct, int ldc, void* d, int dt, int ldd, int compute, int algo,
    int32_t sol, uint32_t flags) {
  int64_t v[] = {(int64_t)h, ta, tb, m, n, k, (int64_t)a, at, lda, (int64_t)b, bt, ldb,
                 (int64_t)c, ct, ldc, (int64_t)d, dt, ldd, compute, algo, sol, flags};
  for (int i = 0; i < 22; ++i) seen[i] = v[i];
  scalars[0] = *(const float*)alpha; scalars[1] = *(const float*)beta; calls += 1; return 0; }
int rocblas_gemm_strided_batched_ex(rocblas_handle h, int ta, int tb, int m, int n, int k,
    const void* alpha, const void* a, int at, int lda, int64_t sa, const void* b, int bt,
    int ldb, int64_t sb, const void* beta, const void* c, int ct, int ldc, int64_t sc,
    void* d, int dt, int ldd, int64_t sd, int count, int compute, int algo, int32_t sol,
    uint32_t flags) {
  int64_t v[] = {(int64_t)h, ta, tb, m, n, k, (int64_t)a, at, lda, sa, (int64_t)b, bt, ldb,
                 sb, (int64_t)c, ct, ldc, sc, (int64_t)d, dt, ldd, sd, count, compute, algo,
                 sol, flags};
  for (int i = 0; i < 27; ++i) seen[i] = v[i];
  scalars[0] = *(const float*)alpha; scalars[1] = *(const float*)beta; calls += 1; return 0; }
"""


def test_rocblas_ctypes_bindings_pass_the_header_arguments(tmp_path):
    """RocblasGemm against a stub librocblas with the signatures of rocblas-functions.h
    (rocBLAS b520bc8): every argument lands where the header puts it."""
    from graphopt.executor.numerics.gpu_gemm import (
        ROCBLAS_GEMM_FLAGS_FP16_ALT_IMPL,
        ROCBLAS_GEMM_FLAGS_FP16_ALT_IMPL_RNZ,
        GemmCall,
        RocblasGemm,
    )

    cc = shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    source = tmp_path / "stub.c"
    source.write_text(ROCBLAS_STUB)
    library_path = tmp_path / "librocblas_stub.so"
    subprocess.run([cc, "-O1", "-shared", "-fPIC", "-o", str(library_path), str(source)],
                   check=True, capture_output=True, timeout=120)
    library = ctypes.CDLL(str(library_path))
    rocblas = RocblasGemm(library)
    seen = (ctypes.c_int64 * 40).in_dll(library, "seen")
    scalars = (ctypes.c_float * 2).in_dll(library, "scalars")
    flags = ROCBLAS_GEMM_FLAGS_FP16_ALT_IMPL | ROCBLAS_GEMM_FLAGS_FP16_ALT_IMPL_RNZ
    assert flags == 0x14

    single = GemmCall(CUBLAS_OP_T, CUBLAS_OP_N, 3, 5, 7, 0, 9, 0, 0, 11, 0, 0, 3, 0, 1)
    rocblas.run(0x1000, 0x2000, single, 0x3000, 0x4000, 0x5000, 2, 2, flags)
    assert list(seen[:22]) == [0x1000, 112, 111, 3, 5, 7, 0x3000, 150, 9, 0x4000, 150, 11,
                               0x5000, 150, 3, 0x5000, 150, 3, 151, 0, 0, 0x14]
    assert list(scalars) == [1.0, 0.0]
    assert seen[38] == 0x2000 and seen[39] == 7  # on CuPy's stream; pointer mode restored

    batched = GemmCall(CUBLAS_OP_N, CUBLAS_OP_T, 3, 5, 7, 0, 3, 0, 0, 5, 35, 0, 3, 15, 4)
    rocblas.run(0x1000, 0x2000, batched, 0x3000, 0x4000, 0x5000, 14, 0, 0)  # BF16 in, F32 out
    assert list(seen[:27]) == [0x1000, 111, 112, 3, 5, 7, 0x3000, 168, 3, 0, 0x4000, 168, 5,
                               35, 0x5000, 151, 3, 15, 0x5000, 151, 3, 15, 4, 151, 0, 0, 0]


def test_non_fp16_nd_at_2d_is_one_gemm():
    """FP32 (B, S, H) @ (H, O) with numerics on: one (B*S, H) @ (H, O) product, not a
    batched one (CuPy would run a pointer-array sgemmBatched)."""
    from graphopt.executor.numerics import Fp16Policy, Numerics

    seen = []

    class Xp:
        float16 = np.float16
        __name__ = "numpy_recorder"

        @staticmethod
        def matmul(a, b):
            seen.append((a.ndim, b.ndim))
            return np.matmul(a, b)

    a = np.random.default_rng(2).standard_normal((3, 4, 5)).astype(np.float32)
    b = np.random.default_rng(3).standard_normal((5, 6)).astype(np.float32)
    got = Numerics("native", Fp16Policy(), xp=Xp).matmul(a, b)
    np.testing.assert_allclose(got, a @ b, rtol=1e-6)
    assert seen == [(2, 2)]

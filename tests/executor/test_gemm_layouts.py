"""executor.gemm.plain_matmul folds a broadcast (shared) operand's axis into the rows of the
other; every layout it takes must give numpy's matmul, and the FP16 policy object must still
see every FP16 product."""

import numpy as np
import pytest

from graphopt.executor import gemm
from graphopt.executor.backend import select_backend
from graphopt.executor.context import KernelContext
from graphopt.executor.numerics import Numerics

B, S, H, D = 2, 5, 3, 4


def _qkv():
    return np.random.default_rng(0).standard_normal((B, S, H + 2, D)).astype(np.float32)


@pytest.mark.parametrize("layout", ["contiguous", "strided_view", "needs_copy"])
def test_shared_operand_fold_matches_numpy(layout):
    qkv = _qkv()
    k = qkv[:, :, H].transpose(0, 2, 1)[:, None]  # (B, 1, D, S): one head for all
    if layout == "contiguous":
        q = np.ascontiguousarray(qkv[:, :, :H].transpose(0, 2, 1, 3))  # (B, H, S, D)
    elif layout == "strided_view":
        q = np.ascontiguousarray(qkv[:, :, :H]).transpose(0, 2, 1, 3)  # rows = S*H view
    else:
        q = qkv[:, :, :H].transpose(0, 2, 1, 3)  # neither fold is a view
    got = gemm.plain_matmul(np, q, k)
    np.testing.assert_allclose(got, np.matmul(q, k), rtol=1e-5, atol=1e-6)
    assert got.shape == (B, H, S, S)


def test_batched_by_2d_and_plain_cases_match_numpy():
    rng = np.random.default_rng(1)
    a = rng.standard_normal((2, 3, 4, 5)).astype(np.float32)
    for b in (rng.standard_normal((5, 6)), rng.standard_normal((2, 3, 5, 6)),
              rng.standard_normal((2, 1, 5, 6)), rng.standard_normal((1, 1, 5, 6))):
        b = b.astype(np.float32)
        np.testing.assert_allclose(gemm.plain_matmul(np, a, b), np.matmul(a, b),
                                   rtol=1e-5, atol=1e-6)


class _CountingNumerics(Numerics):
    def __init__(self):
        super().__init__("native", xp=np)
        self.seen = []

    def matmul(self, a, b, op="gemm"):
        self.seen.append(a.dtype)
        return super().matmul(a, b, op=op)


def test_fp16_only_numerics_sees_every_fp16_product_and_no_other():
    numerics = _CountingNumerics()
    ctx = KernelContext(select_backend("cpu"), numerics, False, 0)
    x = np.ones((2, 3), np.float32)
    gemm.matmul(ctx, x, x.T)
    gemm.matmul(ctx, x.astype(np.float16), x.T.astype(np.float16))
    assert numerics.seen == [np.float16]


def _fused_matmul(a, b, alpha):
    from graphopt.executor.kernels.linalg import fused_matmul
    from graphopt.executor.plan import PlannedNode

    node = PlannedNode(index=0, name="f", op_type="FusedMatMul", domain="com.microsoft",
                       opset=1, inputs=("a", "b"), outputs=("y",), attrs={"alpha": alpha})
    return fused_matmul(KernelContext(select_backend("cpu"), None, False, 0), node, a, b)


@pytest.mark.parametrize("alpha", [0.125, 0.1767767])
def test_fused_matmul_alpha_on_the_smaller_operand(alpha):
    # attention: (B, H, S, D) x (B, 1, D, S), alpha = 1/sqrt(D) applied to K, not the scores
    qkv = _qkv()
    q = qkv[:, :, :H].transpose(0, 2, 1, 3)
    k = qkv[:, :, H].transpose(0, 2, 1)[:, None]
    got = _fused_matmul(q, k, alpha)
    expected = alpha * np.matmul(q.astype(np.float64), k.astype(np.float64))
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    if alpha == 0.125:  # a power of two scales exactly either way
        np.testing.assert_array_equal(got, np.matmul(q, k) * np.float32(alpha))
    vector = _fused_matmul(np.float32([1.0, 2.0]), np.float32([3.0, 4.0]), alpha)
    np.testing.assert_allclose(vector, alpha * 11.0, rtol=1e-6)


def test_fused_matmul_alpha_does_not_scale_an_fp16_input():
    # 1e-4 * 1e-3 is an FP16 subnormal: scaling the input first would lose 19% of the product
    a, b = np.float16([[1e-4], [1e-4]]), np.float16([[1000.0, 1000.0]])
    np.testing.assert_allclose(_fused_matmul(a, b, 1e-3).astype(np.float64), 1e-4, rtol=2e-3)

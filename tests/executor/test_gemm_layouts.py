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

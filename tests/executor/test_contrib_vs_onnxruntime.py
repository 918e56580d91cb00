"""com.microsoft ops that ONNX Runtime's inference build has: compare with onnxruntime."""

from __future__ import annotations

import itertools

import numpy as np
import onnxruntime as ort
import pytest
from support.layouts import relaid

from graphopt.executor import Session

from .helpers import MS, single_node_model


def _both(op_type, inputs, attrs=None):
    """The executor's result and onnxruntime's; the executor's is checked to hold with the
    inputs in other memory layouts too (support/layouts.py)."""
    model = single_node_model(op_type, inputs, domain=MS, attrs=attrs)
    session = Session(model, device="cpu")
    ours = session.run(inputs)["y0"]
    relaid_inputs = {name: relaid(value, position)
                     for position, (name, value) in enumerate(inputs.items())}
    loose = ours.dtype == np.float16
    np.testing.assert_allclose(session.run(relaid_inputs)["y0"], ours,
                               rtol=2e-3 if loose else 1e-5, atol=1e-3 if loose else 1e-6,
                               err_msg="the inputs in other memory layouts")
    ref = ort.InferenceSession(model.SerializeToString(),
                               providers=["CPUExecutionProvider"]).run(None, inputs)[0]
    return ours, ref




def _operand_shape(batch, rows, cols, trans_batch, trans):
    """Shape of an operand that, after transBatch then trans, is (*batch, rows, cols)."""
    shape = list(batch) + [rows, cols]
    if trans:
        shape[-1], shape[-2] = shape[-2], shape[-1]
    if trans_batch:  # inverse of perm [1..r-2, 0, r-1]: the dim before last goes to front
        shape = [shape[-2]] + shape[:-2] + [shape[-1]]
    return tuple(shape)


@pytest.mark.parametrize("trans_a, trans_b, tb_a, tb_b", list(itertools.product([0, 1], repeat=4)))
@pytest.mark.parametrize("alpha", [1.0, 0.125])
def test_fused_matmul_all_flag_combinations(trans_a, trans_b, tb_a, tb_b, alpha):
    rng = np.random.default_rng(trans_a * 8 + trans_b * 4 + tb_a * 2 + tb_b)
    batch, m, k, n = (3, 2), 4, 5, 6
    a = rng.standard_normal(_operand_shape(batch, m, k, tb_a, trans_a)).astype(np.float32)
    b = rng.standard_normal(_operand_shape(batch, k, n, tb_b, trans_b)).astype(np.float32)
    attrs = dict(transA=trans_a, transB=trans_b, transBatchA=tb_a, transBatchB=tb_b, alpha=alpha)
    ours, ref = _both("FusedMatMul", {"a": a, "b": b}, attrs)
    assert ours.shape == ref.shape == batch + (m, n)
    np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("a_shape, b_shape, attrs", [
    ((5,), (5, 3), {}),
    ((4, 5), (5,), {"alpha": 2.0}),
    ((2, 4, 5), (5, 3), {}),  # broadcasting B
    ((4, 5), (2, 3, 5), {"transB": 1}),
    ((5, 4), (5, 3), {"transA": 1, "alpha": -0.5}),
])
def test_fused_matmul_rank_one_and_broadcasting(a_shape, b_shape, attrs):
    rng = np.random.default_rng(7)
    a = rng.standard_normal(a_shape).astype(np.float32)
    b = rng.standard_normal(b_shape).astype(np.float32)
    ours, ref = _both("FusedMatMul", {"a": a, "b": b}, attrs)
    np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_gelu(dtype):
    x = (np.random.default_rng(0).standard_normal((8, 64)) * 3).astype(dtype)
    ours, ref = _both("Gelu", {"x": x})
    tol = 1e-5 if dtype == np.float32 else 2e-3
    np.testing.assert_allclose(ours.astype(np.float32), ref.astype(np.float32), rtol=tol, atol=tol)


@pytest.mark.parametrize("with_bias", [False, True])
def test_fast_gelu(with_bias):
    rng = np.random.default_rng(1)
    inputs = {"x": (rng.standard_normal((4, 32)) * 3).astype(np.float32)}
    if with_bias:
        inputs["bias"] = rng.standard_normal(32).astype(np.float32)
    ours, ref = _both("FastGelu", inputs)
    np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-5)


def test_bias_gelu():
    rng = np.random.default_rng(2)
    inputs = {"x": (rng.standard_normal((4, 32)) * 3).astype(np.float32),
              "bias": rng.standard_normal(32).astype(np.float32)}
    ours, ref = _both("BiasGelu", inputs)
    np.testing.assert_allclose(ours, ref, rtol=1e-5, atol=1e-5)

"""README promises of the FP16 policy that the table tests did not pin: a partial GEMM
mapping keeps the library default for the side it leaves out, rocBLAS's _RNZ switch is any
non-zero atoi value, MIOpen's strtoull reads "-0" as 0, and only ``__backwardpass=1`` (not
the mere presence of the attribute) puts a node under the BackwardPassGuard."""
from __future__ import annotations

import warnings

import numpy as np
import pytest
from onnx import TensorProto, helper

from graphopt.executor import Session
from graphopt.executor.numerics import ALTERNATE, GEMM_RNZ_ENV, ORIGINAL, Fp16Policy
from graphopt.executor.numerics.c_parsing import c_strtoull, miopen_int_value
from graphopt.executor.numerics.policy import RNZ, TRUNCATE

from .helpers import SUBNORMAL


@pytest.mark.parametrize("given, forward, backward", [
    ({"forward": ORIGINAL}, ORIGINAL, ALTERNATE),
    ({"forward": ALTERNATE}, ALTERNATE, ALTERNATE),
    ({"backward": ORIGINAL}, ORIGINAL, ORIGINAL),
    ({}, ORIGINAL, ALTERNATE),
])
def test_a_gemm_mapping_leaves_the_unnamed_side_at_the_guard_default(given, forward, backward):
    policy = Fp16Policy(gemm=given)
    assert (policy.gemm_forward, policy.gemm_backward) == (forward, backward)
    assert policy.implementation("gemm", backward=False) == forward
    assert policy.implementation("gemm", backward=True) == backward


@pytest.mark.parametrize("value, rounding", [
    ("0", TRUNCATE), ("1", RNZ), ("2", RNZ), ("-1", RNZ), ("17abc", RNZ), ("abc", TRUNCATE),
    (" 0", TRUNCATE),
])
def test_rnz_rounding_is_selected_by_any_non_zero_atoi_value(value, rounding):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # values other than 0/1 warn; not what is pinned here
        assert Fp16Policy.from_env({GEMM_RNZ_ENV: value}).gemm_rounding == rounding


@pytest.mark.parametrize("text", ["-0", "-00", "-0x0", " -0"])
def test_strtoull_of_minus_zero_is_zero(text):
    assert c_strtoull(text) == 0
    assert miopen_int_value(text) == 0


def test_strtoull_negation_wraps_modulo_2_64():
    assert c_strtoull("-1") == 2**64 - 1
    assert c_strtoull("-0x10") == 2**64 - 16


def _matmul(name: str, backward_attr: int | None):
    node = helper.make_node("MatMul", ["a", "b"], [name], name=name)
    if backward_attr is not None:
        node.attribute.append(helper.make_attribute("__backwardpass", backward_attr))
    return node


@pytest.mark.parametrize("attr, kept", [(None, False), (0, False), (1, True)])
def test_only_backwardpass_1_runs_under_the_backward_pass_guard(attr, kept):
    """Under MI200 numerics with the default policy, the forward (original) GEMM flushes an
    FP16 subnormal input and the backward (alternate) one keeps it; a node marked
    ``__backwardpass=0`` is a forward node."""
    graph = helper.make_graph(
        [_matmul("y", attr)], "g",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT16, [1, 2]),
         helper.make_tensor_value_info("b", TensorProto.FLOAT16, [2, 1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [1, 1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    feeds = {"a": np.array([[SUBNORMAL, 1.0]], np.float16),
             "b": np.array([[1.0], [0.0]], np.float16)}
    session = Session(model, device="cpu", numerics="mi200", fp16_policy=Fp16Policy())
    out = session.run(feeds)["y"][0, 0]
    assert out == (SUBNORMAL if kept else 0)

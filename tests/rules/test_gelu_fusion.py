"""gelu_fusion: exact GELU written out (Div/Mul by sqrt(2), Erf, Add 1, two Muls) -> Gelu."""
from __future__ import annotations

import collections
import glob
import os

import numpy as np
import onnx
import pytest
from conftest import (
    FIXTURES,
    assert_declined,
    assert_same_outputs,
    assert_second_run_changes_nothing,
    model_from_text,
    op_types,
    ort_optimized,
    random_feeds,
)

import graphopt
from graphopt.executor import Session
from graphopt.training.prepare import prepare_training

RULE = "gelu_fusion"
SCALE = {"div": "s = Div(x, c_sqrt2)", "mul": "s = Mul(x, c_inv_sqrt2)"}
# the three ways to group x * 0.5 * (1 + erf), and the constants written first
PRODUCTS = {
    "x_times_shifted_then_half": "p = Mul(x, a)\n y = Mul(p, c_half)",
    "half_x_times_shifted": "p = Mul(x, c_half)\n y = Mul(p, a)",
    "x_times_half_shifted": "p = Mul(a, c_half)\n y = Mul(x, p)",
    "constants_first": "p = Mul(c_half, x)\n y = Mul(a, p)",
}
CONSTANTS = "float c_sqrt2 = {1.4142135}, float c_one = {1.0}, float c_half = {0.5}"


def gelu_model(scale="div", product="x_times_shifted_then_half", shifted="a = Add(e, c_one)",
               elem=None, shape="[2,3,8]", constants=CONSTANTS, extra="", outputs=None):
    """The GELU subgraph in float; ``elem`` (a numpy dtype) retypes x, y and the constants."""
    if scale == "mul":
        constants = constants.replace("c_sqrt2 = {1.4142135}", "c_inv_sqrt2 = {0.70710677}")
    model = model_from_text(f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float{shape} x) => ({outputs or f"float{shape} y"}) <{constants}>
        {{
        {SCALE[scale]}
        e = Erf(s)
        {shifted}
        {PRODUCTS[product]}
        {extra}
        }}""")
    return model if elem is None else retyped(model, elem)


def retyped(model, dtype):
    """``model`` with every float tensor (inputs, outputs, constants) of ``dtype``; the
    constants are the float64 values of sqrt(2), 1/sqrt(2), 1 and 0.5 rounded to it."""
    exact = {"c_sqrt2": np.sqrt(2.0), "c_inv_sqrt2": np.sqrt(0.5)}
    elem = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    for value in [*model.graph.input, *model.graph.output]:
        value.type.tensor_type.elem_type = elem
    for tensor in model.graph.initializer:
        array = onnx.numpy_helper.to_array(tensor).astype(np.float64)
        array = np.full_like(array, exact.get(tensor.name, array.reshape(-1)[0]))
        tensor.CopyFrom(onnx.numpy_helper.from_array(array.astype(dtype), tensor.name))
    onnx.checker.check_model(model)
    return model


def run(model, **kw):
    return graphopt.optimize(model, [RULE], **kw)


@pytest.mark.parametrize("product", list(PRODUCTS))
@pytest.mark.parametrize("scale", list(SCALE))
def test_every_grouping_becomes_one_gelu(scale, product):
    model = gelu_model(scale, product)
    out, report = run(model)
    assert op_types(out) == ["Gelu"]
    (node,) = out.graph.node
    assert node.domain == "com.microsoft"
    assert list(node.input) == ["x"] and list(node.output) == ["y"]
    assert [t.name for t in out.graph.initializer] == []  # the constants died with the nodes
    assert report.rules[RULE].rewrites == 1
    assert_same_outputs(model, out, rtol=1e-6, atol=1e-6)  # onnxruntime runs both
    assert_second_run_changes_nothing(out, [RULE])


def test_one_written_first_and_constant_nodes():
    model = model_from_text("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4,8] x) => (float[4,8] y)
        {
        r = Constant <value = float {1.4142135}> ()
        one = Constant <value = float[1] {1.0}> ()
        h = Constant <value = float {0.5}> ()
        s = Div(x, r)
        e = Erf(s)
        a = Add(one, e)
        p = Mul(x, a)
        y = Mul(p, h)
        }""")
    out, _ = run(model)
    assert op_types(out) == ["Gelu"]
    assert_same_outputs(model, out, rtol=1e-6, atol=1e-6)


def test_onnxruntime_fuses_the_same_subgraph(tmp_path):
    # onnxruntime's own GeluFusion (level 2) finds the Div form its way too
    theirs = ort_optimized(gelu_model("div", "half_x_times_shifted"), tmp_path)
    assert op_types(theirs) == ["Gelu"]


@pytest.mark.parametrize("elem", [np.float16, np.float64])
def test_float16_and_double(elem):
    model = gelu_model(elem=elem)
    out, _ = run(model)
    assert op_types(out) == ["Gelu"]
    feeds = random_feeds(model)
    (expected,) = Session(model, device="cpu").run(feeds).values()
    (actual,) = Session(out, device="cpu").run(feeds).values()
    tolerance = 2e-3 if elem == np.float16 else 1e-12
    np.testing.assert_allclose(actual, expected, rtol=tolerance, atol=tolerance)


def test_constants_rounded_to_their_type_match_and_others_do_not():
    # sqrt(2) in float16 is 1.4140625: that graph means GELU, so it fuses; in float64 a
    # float32 sqrt(2) (1.4142135) is another function, so it does not
    model = gelu_model(elem=np.float16)
    assert onnx.numpy_helper.to_array(model.graph.initializer[0]) == np.float16(1.4140625)
    assert op_types(run(model)[0]) == ["Gelu"]
    model = gelu_model(elem=np.float64)
    model.graph.initializer[0].CopyFrom(
        onnx.numpy_helper.from_array(np.array(np.float32(np.sqrt(2.0)), np.float64), "c_sqrt2"))
    assert_declined(model, RULE, "sqrt2 is not sqrt(2)")


@pytest.mark.parametrize("constants, reason", [
    (CONSTANTS.replace("1.4142135", "1.5"), "sqrt2 is not sqrt(2)"),
    (CONSTANTS.replace("{1.0}", "{2.0}"), "one is not 1"),
    (CONSTANTS.replace("{0.5}", "{0.4}"), "half is not 0.5"),
    (CONSTANTS.replace("float c_half = {0.5}", "float[2] c_half = {0.5, 0.5}"),
     "'half' (c_half) has 2 elements, not one"),
])
def test_other_constants_are_not_gelu(constants, reason):
    assert_declined(gelu_model(constants=constants), RULE, reason)


def test_intermediate_with_another_reader_is_not_fused():
    # the Erf is also an output: fusing would compute it twice
    model = gelu_model(outputs="float[2,3,8] y, float[2,3,8] e")
    assert_declined(model, RULE, "has other consumers")


def test_erf_of_another_tensor_is_not_gelu():
    model = model_from_text(f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4] x, float[4] z) => (float[4] y) <{CONSTANTS}>
        {{
        s = Div(z, c_sqrt2)
        e = Erf(s)
        a = Add(e, c_one)
        p = Mul(x, a)
        y = Mul(p, c_half)
        }}""")
    out, _ = run(model)
    assert "Gelu" not in op_types(out)


def test_rank_1_constant_on_a_rank_0_input_is_not_fused():
    # x * [0.5] is rank 1 for a scalar x; Gelu(x) would be rank 0
    model = gelu_model(shape="", outputs="float[1] y",
                       constants=CONSTANTS.replace("float c_half = {0.5}",
                                                   "float[1] c_half = {0.5}"))
    assert_declined(model, RULE, "a rank-1 constant would broadcast a rank-0 x to rank 1")


def test_not_run_at_level_1():
    model = gelu_model()
    out, report = graphopt.optimize(model, level=1)
    assert out.SerializeToString() == model.SerializeToString()
    assert RULE not in report.rules


def _hf_exports():
    return sorted(os.path.basename(p)[:-5] for p in glob.glob(os.path.join(FIXTURES, "hf_*.onnx")))


@pytest.mark.parametrize("name", _hf_exports())
def test_every_exact_gelu_of_the_hf_exports_is_fused(name, tmp_path):
    """PyTorch's exact GELU, as TorchScript and dynamo write it: one Gelu per Erf, and never
    fewer than onnxruntime's level 2 makes (it misses dynamo's Mul by 1/sqrt(2))."""
    model = onnx.load(os.path.join(FIXTURES, f"{name}.onnx"))
    erfs = op_types(model).count("Erf")
    ours = collections.Counter(op_types(graphopt.optimize(model, level=2)[0]))
    theirs = collections.Counter(op_types(ort_optimized(model, tmp_path)))
    assert ours["Gelu"] == erfs and ours["Erf"] == 0
    assert ours["Gelu"] >= theirs["Gelu"] + theirs["BiasGelu"]


def _mlp_with_gelu():
    rng = np.random.default_rng(0)
    model = onnx.parser.parse_model(f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[5,8] x, float[8,16] w1, float[16,4] w2) => (float[5,4] out) <{CONSTANTS}>
        {{
        h = MatMul(x, w1)
        s = Div(h, c_sqrt2)
        e = Erf(s)
        a = Add(e, c_one)
        p = Mul(h, a)
        y = Mul(p, c_half)
        out = MatMul(y, w2)
        }}""")
    for name, shape in (("w1", (8, 16)), ("w2", (16, 4))):  # weights, not inputs
        model.graph.input.remove(next(i for i in model.graph.input if i.name == name))
        model.graph.initializer.append(onnx.numpy_helper.from_array(
            rng.standard_normal(shape).astype(np.float32), name))
    onnx.checker.check_model(model)
    return model


def test_training_fuses_before_differentiation_and_keeps_the_gradients():
    """The forward graph gets the fusion before it is differentiated (Gelu -> GeluGrad): the
    same loss and gradients as the graph differentiated through Erf."""
    model = _mlp_with_gelu()
    fused, reports = prepare_training(model, loss="mse")
    plain, _ = prepare_training(model, loss="mse", disable=(RULE,))
    kinds = collections.Counter(op_types(fused.proto))
    assert kinds["Gelu"] == 1 and kinds["GeluGrad"] == 1 and kinds["Erf"] == 0
    assert "Erf" in op_types(plain.proto)
    assert "gelu_fusion" in reports[0][0] and reports[0][1].rules[RULE].rewrites == 1
    feeds = random_feeds(fused.proto)
    wanted = fused.losses + [fused.grads[p] for p in fused.params]
    got = Session(fused.proto, device="cpu").run(feeds, wanted)
    expected = Session(plain.proto, device="cpu").run(feeds, wanted)
    for name in wanted:
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-5, atol=1e-6)


def test_training_at_level_1_keeps_the_erf():
    fused, reports = prepare_training(_mlp_with_gelu(), loss="mse", level=1)
    assert "Gelu" not in op_types(fused.proto) and "Erf" in op_types(fused.proto)
    assert reports[0][0] == "forward graph, level 1 (before differentiation)"

"""gelu_fusion: exact GELU written out (Div/Mul by sqrt(2), Erf, Add 1, two Muls) -> Gelu."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from support.activation_fusions import (
    assert_fused_before_differentiation,
    assert_fused_into_one_node,
    assert_same_in_the_executor,
    fused_counts,
    hf_exports,
    mlp_model,
    retyped,
)
from support.models import (
    assert_declined,
    assert_level_2_only,
    assert_same_outputs,
    model_from_text,
    op_types,
    ort_optimized,
)

import graphopt
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
EXACT = {"c_sqrt2": np.sqrt(2.0), "c_inv_sqrt2": np.sqrt(0.5)}
GELU = """s = Div(h, c_sqrt2)
        e = Erf(s)
        a = Add(e, c_one)
        p = Mul(h, a)
        y = Mul(p, c_half)"""


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
    return model if elem is None else retyped(model, elem, EXACT)


def run(model, **kw):
    return graphopt.optimize(model, [RULE], **kw)


@pytest.mark.parametrize("product", list(PRODUCTS))
@pytest.mark.parametrize("scale", list(SCALE))
def test_every_grouping_becomes_one_gelu(scale, product):
    assert_fused_into_one_node(gelu_model(scale, product), RULE, "Gelu", 1e-6)


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
    assert_same_in_the_executor(gelu_model(elem=elem), RULE, "Gelu")


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
    assert_level_2_only(gelu_model(), RULE)


@pytest.mark.parametrize("name", hf_exports())
def test_every_exact_gelu_of_the_hf_exports_is_fused(name):
    """PyTorch's exact GELU, as TorchScript and dynamo write it: one Gelu per Erf (level 2's
    bias_gelu_fusion then makes a BiasGelu of one that reads a biased sum), and never fewer
    than onnxruntime's level 2 makes (it misses dynamo's Mul by 1/sqrt(2))."""
    exported, ours, theirs = fused_counts(name)
    assert ours["Gelu"] + ours["BiasGelu"] == exported["Erf"] and ours["Erf"] == 0
    assert ours["Gelu"] + ours["BiasGelu"] >= theirs["Gelu"] + theirs["BiasGelu"]


def test_training_fuses_before_differentiation_and_keeps_the_gradients():
    """The forward graph gets the fusion before it is differentiated (Gelu -> GeluGrad): the
    same loss and gradients as the graph differentiated through Erf."""
    assert_fused_before_differentiation(mlp_model(GELU, CONSTANTS), RULE, "Gelu", "GeluGrad",
                                        "Erf")


def test_training_at_level_1_keeps_the_erf():
    fused, reports = prepare_training(mlp_model(GELU, CONSTANTS), loss="mse", level=1)
    assert "Gelu" not in op_types(fused.proto) and "Erf" in op_types(fused.proto)
    assert reports[0][0] == "forward graph, level 1 (before differentiation)"

"""bias_gelu_fusion: Gelu(Add(x, bias)), bias a vector along x's last axis -> BiasGelu."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from support.activation_fusions import (
    assert_fused_before_differentiation,
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
    assert_second_run_changes_nothing,
    model_from_text,
    op_types,
    ort_optimized,
)

import graphopt

RULE = "bias_gelu_fusion"
GELUS = {  # com.microsoft's Gelu (what gelu_fusion makes), ONNX's (opset 20)
    "com.microsoft": ('"" : 17, "com.microsoft" : 1', "com.microsoft.Gelu"),
    "onnx": ('"" : 20', "Gelu"),
}


def biased_gelu(gelu="com.microsoft", sum_="s = Add(x, bias)", bias="float[8] bias",
                shape="[2,3,8]", extra="", outputs=None):
    opsets, call = GELUS[gelu]
    return model_from_text(f"""
        <ir_version: 9, opset_import: [{opsets}]>
        g (float{shape} x, {bias}) => ({outputs or f"float{shape} y"})
        {{
        {sum_}
        y = {call}(s)
        {extra}
        }}""")


def run(model, **kw):
    return graphopt.optimize(model, [RULE], **kw)


@pytest.mark.parametrize("sum_", ["s = Add(x, bias)", "s = Add(bias, x)"])
@pytest.mark.parametrize("gelu", list(GELUS))
def test_gelu_of_a_biased_sum_becomes_one_bias_gelu(gelu, sum_):
    model = biased_gelu(gelu, sum_)
    out, report = run(model)
    (node,) = out.graph.node
    assert (node.op_type, node.domain) == ("BiasGelu", "com.microsoft")
    assert list(node.input) == ["x", "bias"] and list(node.output) == ["y"]
    assert report.rules[RULE].rewrites == 1
    assert_same_outputs(model, out, rtol=1e-6, atol=1e-6)  # onnxruntime runs both
    assert_second_run_changes_nothing(out, [RULE])


def test_a_bias_initializer_of_a_linear_layer():
    model = model_from_text("""
        <ir_version: 8, opset_import: ["" : 17, "com.microsoft" : 1]>
        g (float[4,6] x, float[6,8] w) => (float[4,8] y)
          <float[8] bias = {1.0, -2.0, 0.5, 0.0, 3.0, -0.25, 0.125, 2.0}>
        {
        h = MatMul(x, w)
        s = Add(h, bias)
        y = com.microsoft.Gelu(s)
        }""")
    out, _ = run(model)
    assert op_types(out) == ["MatMul", "BiasGelu"]
    assert_same_outputs(model, out, rtol=1e-6, atol=1e-6)


def test_onnxruntime_fuses_the_same_subgraph(tmp_path):
    theirs = ort_optimized(biased_gelu(), tmp_path)
    assert op_types(theirs) == ["BiasGelu"]


@pytest.mark.parametrize("elem", [np.float16, np.float64])
def test_float16_and_double(elem):
    assert_same_in_the_executor(retyped(biased_gelu(), elem, {}), RULE, "BiasGelu")


@pytest.mark.parametrize("model, reason", [
    (biased_gelu(bias="float[3] bias", shape="[8,3]", sum_="s = Add(x, bias)"), None),
    (biased_gelu(bias="float[1,8] bias"), "no operand of the sum is a vector along"),
    (biased_gelu(bias="float[1] bias"), "no operand of the sum is a vector along"),
    (biased_gelu(bias="float[3,1] bias", shape="[3,8]"), "no operand of the sum is a vector"),
    (biased_gelu(bias="float[N] bias", shape="[2,N]"), "no operand of the sum is a vector"),
    (biased_gelu(bias="float[8] bias", shape="[8]"), None),
])
def test_only_a_vector_along_the_last_axis_is_a_bias(model, reason):
    if reason is None:  # a vector along the last axis, whatever x's rank: fused
        assert op_types(run(model)[0]) == ["BiasGelu"]
    else:
        assert_declined(model, RULE, reason)


def test_the_tanh_approximation_is_not_fused():
    model = biased_gelu("onnx")
    gelu = model.graph.node[1]
    gelu.attribute.append(onnx.helper.make_attribute("approximate", "tanh"))
    assert_declined(model, RULE, "Gelu has approximate='tanh', not 'none'")


def test_a_sum_with_another_reader_is_not_fused():
    model = biased_gelu(outputs="float[2,3,8] y, float[2,3,8] s")
    assert_declined(model, RULE, "has other consumers")


def test_integer_operands_are_not_fused():
    model = model_from_text("""
        <ir_version: 9, opset_import: ["" : 20]>
        g (int32[2,8] x, int32[8] bias) => (float[2,8] y)
        {
        s = Add(x, bias)
        f = Cast <to = 1> (s)
        y = Gelu(f)
        }""")
    assert RULE not in [n.op_type for n in run(model)[0].graph.node]
    assert op_types(run(model)[0]) == ["Add", "Cast", "Gelu"]


def test_not_run_at_level_1():
    assert_level_2_only(biased_gelu(), RULE)


@pytest.mark.parametrize("name", hf_exports())
def test_the_hf_exports_fuse_at_least_what_onnxruntime_fuses(name):
    """Every exact GELU of an export that reads a linear layer's biased output becomes a
    BiasGelu, never fewer than onnxruntime's level 2 makes."""
    exported, ours, theirs = fused_counts(name)
    assert ours["Gelu"] + ours["BiasGelu"] == exported["Erf"]
    assert ours["BiasGelu"] >= theirs["BiasGelu"]


# an exported exact GELU (gelu_fusion makes it a Gelu) of a linear layer's biased output
GELU_OF_BIASED = """s = Add(h, c_bias)
        d = Div(s, c_sqrt2)
        e = Erf(d)
        a = Add(e, c_one)
        p = Mul(s, a)
        y = Mul(p, c_half)"""
CONSTANTS = ("float c_sqrt2 = {1.4142135}, float c_one = {1.0}, float c_half = {0.5}, "
             "float[16] c_bias = {" + ", ".join(f"{v:.3f}" for v in np.linspace(-1, 1, 16)) + "}")


def test_training_fuses_before_differentiation_and_keeps_the_gradients():
    """The forward graph gets the fusion before it is differentiated (BiasGelu ->
    BiasGeluGrad_dX, the bias's gradient a ReduceSum): the same loss and gradients as the
    graph differentiated through Add and Gelu."""
    assert_fused_before_differentiation(mlp_model(GELU_OF_BIASED, CONSTANTS), RULE,
                                        "BiasGelu", "BiasGeluGrad_dX", "Gelu")

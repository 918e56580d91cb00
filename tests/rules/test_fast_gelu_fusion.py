"""fast_gelu_fusion: the tanh GELU written out (GPT-2, CodeGen, BLOOM, BigCode) -> FastGelu."""
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
    model_from_text,
    op_types,
)

import graphopt

RULE = "fast_gelu_fusion"
CONSTANTS = ("float c_one = {1.0}, float c_half = {0.5}, float c_slope = {0.7978846}, "
             "float c_k = {0.044715}, float c_three = {3.0}")
EXACT = {"c_slope": np.sqrt(2.0 / np.pi), "c_k": 0.044715}
CUBES = {
    "pow": "c = Pow(x, c_three)",
    "x_times_square": "q = Mul(x, x)\n c = Mul(x, q)",
    "square_times_x": "q = Mul(x, x)\n c = Mul(q, x)",
}
# sqrt(2/pi) * (x + k x^3) (GPT-2), or (sqrt(2/pi) x) (1 + k x x) (BLOOM)
ARGUMENTS = {f"sum_{cube}": f"{body}\n kc = Mul(c, c_k)\n u = Add(x, kc)\n t = Mul(u, c_slope)"
             for cube, body in CUBES.items()}
ARGUMENTS["bloom"] = ("sx = Mul(x, c_slope)\n kx = Mul(x, c_k)\n kxx = Mul(kx, x)\n"
                      " u = Add(kxx, c_one)\n t = Mul(sx, u)")
ARGUMENTS["bloom_square_first"] = ("sx = Mul(x, c_slope)\n xx = Mul(x, x)\n kxx = Mul(xx, c_k)\n"
                                   " u = Add(c_one, kxx)\n t = Mul(u, sx)")
PRODUCTS = {
    "x_times_shifted_then_half": "p = Mul(x, a)\n y = Mul(p, c_half)",
    "half_x_times_shifted": "p = Mul(x, c_half)\n y = Mul(p, a)",
    "x_times_half_shifted": "p = Mul(a, c_half)\n y = Mul(x, p)",
    "half_first": "p = Mul(x, a)\n y = Mul(c_half, p)",  # BigCode's TorchScript export
}


def fast_gelu_model(argument="sum_pow", product="half_x_times_shifted", elem=None,
                    constants=CONSTANTS, shape="[2,3,8]", outputs=None):
    model = model_from_text(f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float{shape} x) => ({outputs or f"float{shape} y"}) <{constants}>
        {{
        {ARGUMENTS[argument]}
        th = Tanh(t)
        a = Add(th, c_one)
        {PRODUCTS[product]}
        }}""")
    used = {i for n in model.graph.node for i in n.input}
    kept = [t for t in model.graph.initializer if t.name in used]  # the form's constants only
    del model.graph.initializer[:]
    model.graph.initializer.extend(kept)
    return model if elem is None else retyped(model, elem, EXACT)


def run(model, **kw):
    return graphopt.optimize(model, [RULE], **kw)


FORMS = ([(argument, "half_x_times_shifted") for argument in ARGUMENTS]
         + [("sum_pow", product) for product in PRODUCTS if product != "half_x_times_shifted"])


@pytest.mark.parametrize("argument, product", FORMS)
def test_every_form_becomes_one_fast_gelu(argument, product):
    assert_fused_into_one_node(fast_gelu_model(argument, product), RULE, "FastGelu", 1e-5)


@pytest.mark.parametrize("elem", [np.float16, np.float64])
def test_float16_and_double(elem):
    assert_same_in_the_executor(fast_gelu_model(elem=elem), RULE, "FastGelu")


def test_integer_exponent_counts():
    model = fast_gelu_model()
    three = next(t for t in model.graph.initializer if t.name == "c_three")
    three.CopyFrom(onnx.numpy_helper.from_array(np.array(3, np.int64), "c_three"))
    assert op_types(run(model)[0]) == ["FastGelu"]


@pytest.mark.parametrize("old, new, reason", [
    ("{0.7978846}", "{0.8}", "slope is not sqrt(2/pi)"),
    ("{0.044715}", "{0.05}", "cubic is not 0.044715"),
    ("{3.0}", "{2.0}", "three is not 3"),
    ("{0.5}", "{0.25}", "half is not 0.5"),
])
def test_other_constants_are_not_fast_gelu(old, new, reason):
    assert_declined(fast_gelu_model(constants=CONSTANTS.replace(old, new)), RULE, reason)


def test_tanh_with_another_reader_is_not_fused():
    model = fast_gelu_model(outputs="float[2,3,8] y, float[2,3,8] th")
    assert_declined(model, RULE, "has other consumers")


def test_rank_1_constant_on_a_rank_0_input_is_not_fused():
    model = fast_gelu_model(shape="", outputs="float[1] y",
                            constants=CONSTANTS.replace("float c_half", "float[1] c_half"))
    assert_declined(model, RULE, "a rank-1 constant would broadcast a rank-0 x to rank 1")


def test_not_run_at_level_1():
    assert_level_2_only(fast_gelu_model(), RULE)


@pytest.mark.parametrize("name", hf_exports())
def test_every_tanh_gelu_of_the_hf_exports_is_fused(name):
    """GPT-2's, CodeGen's and BLOOM's tanh GELU and BigCode's gelu(approximate='tanh'), as
    TorchScript and dynamo write them: one FastGelu per Tanh, never fewer than onnxruntime's
    level 2 makes (it misses BigCode's)."""
    exported, ours, theirs = fused_counts(name)
    assert ours["FastGelu"] == exported["Tanh"] and ours["Tanh"] == 0
    assert ours["FastGelu"] >= theirs["FastGelu"]  # on GPT-2, CodeGen and BLOOM it is equal


def test_training_fuses_before_differentiation_and_keeps_the_gradients():
    activation = "\n".join(line.replace("x", "h") for line in (
        ARGUMENTS["sum_pow"] + "\n th = Tanh(t)\n a = Add(th, c_one)\n"
        + PRODUCTS["half_x_times_shifted"]).split("\n"))
    constants = ", ".join(c for c in CONSTANTS.split(", "))
    assert_fused_before_differentiation(mlp_model(activation, constants), RULE, "FastGelu",
                                        "FastGeluGrad", "Tanh")

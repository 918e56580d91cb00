"""matmul_scale_to_fused_matmul: a scalar constant Mul/Div before or after a MatMul -> alpha."""
from __future__ import annotations

import pytest
from support.models import FUSED_MATMUL_DEFAULTS as DEFAULTS
from support.models import (
    assert_level_2_only,
    assert_no_change,
    assert_same_outputs,
    assert_second_run_changes_nothing,
    fused,
    fused_attrs,
    model_from_text,
    op_types,
    ort_optimized,
)

import graphopt

RULE = "matmul_scale_to_fused_matmul"
def run(model, rules=(RULE,), **kw):
    return graphopt.optimize(model, list(rules), **kw)


def build(body, inputs="float[2,5,7] a, float[2,7,4] b", outputs="float[2,5,4] y",
          scale="float s = {4.0}", ms=False):
    opsets = '"" : 17' + (', "com.microsoft" : 1' if ms else "")
    inits = f"<{scale}>" if scale else ""
    return model_from_text(f"""
        <ir_version: 8, opset_import: [{opsets}]>
        g ({inputs}) => ({outputs}) {inits}
        {{
        {body}
        }}""")


POSITIVE = {
    "mul_after": ("p = MatMul(a, b)\n y = Mul(p, s)", 4.0),
    "mul_after_scale_first": ("p = MatMul(a, b)\n y = Mul(s, p)", 4.0),
    "div_after": ("p = MatMul(a, b)\n y = Div(p, s)", 0.25),
    "mul_before_a": ("sa = Mul(a, s)\n y = MatMul(sa, b)", 4.0),
    "mul_before_a_scale_first": ("sa = Mul(s, a)\n y = MatMul(sa, b)", 4.0),
    "div_before_a": ("sa = Div(a, s)\n y = MatMul(sa, b)", 0.25),
    "mul_before_b": ("sb = Mul(b, s)\n y = MatMul(a, sb)", 4.0),
    "div_before_b": ("sb = Div(b, s)\n y = MatMul(a, sb)", 0.25),
}


@pytest.mark.parametrize("case", list(POSITIVE))
def test_scale_folds_into_alpha(case, tmp_path):
    body, alpha = POSITIVE[case]
    model = build(body)
    out, report = run(model)
    assert op_types(out) == ["FusedMatMul"]
    (node,) = fused(out)
    assert node.domain == "com.microsoft"
    assert list(node.input) == ["a", "b"] and list(node.output) == ["y"]
    assert fused_attrs(node) == {**DEFAULTS, "alpha": alpha}
    assert [t.name for t in out.graph.initializer] == []  # the scale is dead and removed
    assert report.rules[RULE].rewrites == 1
    assert_same_outputs(model, out, rtol=1e-5, atol=1e-5)
    assert_second_run_changes_nothing(out, [RULE])
    # onnxruntime's MatMulScaleFusion agrees
    (theirs,) = fused(ort_optimized(model, tmp_path))
    assert fused_attrs(theirs) == pytest.approx(fused_attrs(node))


def test_scale_of_shape_1_is_a_scalar():
    model = build("p = MatMul(a, b)\n y = Mul(p, s)", scale="float[1] s = {0.5}")
    out, _ = run(model)
    assert fused_attrs(fused(out)[0])["alpha"] == 0.5
    assert_same_outputs(model, out, rtol=1e-5, atol=1e-5)


def test_constant_node_scale():
    model = build("s = Constant <value = float {0.125}> ()\n p = MatMul(a, b)\n y = Div(p, s)",
                  scale="")
    out, _ = run(model)
    assert op_types(out) == ["FusedMatMul"]
    assert fused_attrs(fused(out)[0])["alpha"] == 8.0
    assert_same_outputs(model, out, rtol=1e-5, atol=1e-5)


def test_fusedmatmul_base_alpha_multiplies_and_flags_stay():
    model = build("p = com.microsoft.FusedMatMul <alpha = 0.5, transB = 1> (a, b)\n"
                  " y = Mul(p, s)", inputs="float[2,5,7] a, float[2,4,7] b", ms=True)
    out, _ = run(model)
    (node,) = fused(out)
    assert op_types(out) == ["FusedMatMul"]
    assert fused_attrs(node) == {**DEFAULTS, "alpha": 2.0, "transB": 1}
    assert_same_outputs(model, out, rtol=1e-5, atol=1e-5)
    assert_second_run_changes_nothing(out, [RULE])


def test_scales_before_and_after_both_fold():
    model = build("sa = Mul(a, s)\n p = MatMul(sa, b)\n y = Div(p, t)",
                  scale="float s = {2.0}, float t = {8.0}")
    out, report = run(model)
    assert op_types(out) == ["FusedMatMul"]
    assert fused_attrs(fused(out)[0])["alpha"] == 0.25
    assert report.rules[RULE].rewrites == 2
    assert_same_outputs(model, out, rtol=1e-5, atol=1e-5)
    assert_second_run_changes_nothing(out, [RULE])


def test_scaled_input_with_another_consumer_is_not_fused():
    # The Mul would stay for the Relu: folding the scale saves nothing, and in a training
    # graph it would take a forward node out of the YieldOp's ancestry.
    model = build("sa = Mul(a, s)\n y = MatMul(sa, b)\n r = Relu(sa)",
                  outputs="float[2,5,4] y, float[2,5,7] r")
    unchanged(model, "has other consumers")


def unchanged(model, reason=None):
    report = assert_no_change(model, [RULE], explain=[RULE])
    assert report.rules[RULE].rewrites == 0 and report.rules[RULE].rollbacks == 0
    assert report.rules[RULE].candidates >= 1
    text = report.format_explain(RULE)
    if reason is not None:
        assert reason in text, text
    return report


def test_non_scalar_scale_is_rejected():
    unchanged(build("p = MatMul(a, b)\n y = Mul(p, s)", scale="float[4] s = {1.0, 2.0, 3.0, 4.0}"))


def test_non_scalar_scale_before_is_rejected_with_its_reason():
    """Not commutative-swapped at the MatMul anchor, so the real reason is shown."""
    unchanged(build("sb = Div(b, s)\n y = MatMul(a, sb)",
                    scale="float[4] s = {1.0, 2.0, 3.0, 4.0}"),
              "'scale' (s) has 4 elements, not one")


def test_explain_names_the_real_reason_for_a_commutative_mul():
    unchanged(build("p = MatMul(a, b)\n y = Mul(p, s)", scale="float[4] s = {1.0, 2.0, 3.0, 4.0}"),
              "has 4 elements, not one")


def test_rank_2_one_element_scale_is_rejected():
    """Mul by a [1,1] tensor is not a pure scale: it can raise the output's rank."""
    unchanged(build("p = MatMul(a, b)\n y = Mul(p, s)", scale="float[1,1] s = {2.0}"))
    unchanged(build("p = MatMul(a, b)\n y = Div(p, s)", scale="float[1,1] s = {2.0}"),
              "scale is not a float scalar (rank <= 1)")


def test_integer_scale_and_inputs_are_rejected():
    unchanged(build("p = MatMul(a, b)\n y = Mul(p, s)", inputs="int32[2,5,7] a, int32[2,7,4] b",
                    outputs="int32[2,5,4] y", scale="int32 s = {4}"))
    unchanged(build("p = MatMul(a, b)\n y = Div(p, s)", inputs="int32[2,5,7] a, int32[2,7,4] b",
                    outputs="int32[2,5,4] y", scale="int32 s = {4}"),
              "scale is not a float scalar")


def test_integer_inputs_with_scale_before_are_rejected():
    unchanged(build("sa = Div(a, s)\n y = MatMul(sa, b)", inputs="int64[2,5,7] a, int64[2,7,4] b",
                    outputs="int64[2,5,4] y", scale="int64 s = {4}"),
              "scale is not a float scalar")


def test_product_with_two_consumers_is_not_fused():
    model = build("p = MatMul(a, b)\n y = Mul(p, s)\n r = Relu(p)",
                  outputs="float[2,5,4] y, float[2,5,4] r")
    unchanged(model, "has other consumers")


def test_product_that_is_a_graph_output_is_not_fused():
    model = build("p = MatMul(a, b)\n y = Mul(p, s)", outputs="float[2,5,4] y, float[2,5,4] p")
    unchanged(model, "has other consumers")


def test_division_by_zero_is_not_fused():
    unchanged(build("p = MatMul(a, b)\n y = Div(p, s)", scale="float s = {0.0}"),
              "division by zero")


def test_scale_that_is_a_graph_input_is_not_constant():
    model = build("p = MatMul(a, b)\n y = Div(p, s)",
                  inputs="float[2,5,7] a, float[2,7,4] b, float s", scale="")
    unchanged(model, "is not a constant")


def test_not_run_at_level_1():
    assert_level_2_only(build(POSITIVE["mul_after"][0]), RULE)


@pytest.mark.parametrize("body", ["p = MatMul(a, b)\n y = Mul(p, s)",
                                  "p = MatMul(a, b)\n y = Div(p, s)"])
def test_rank_1_scale_of_a_scalar_product_is_not_fused(body):
    """A dot product is rank 0; times a [1] scale it becomes rank 1, which alpha cannot do."""
    unchanged(build(body, inputs="float[4] a, float[4] b", outputs="float[1] y",
                    scale="float[1] s = {2.0}"),
              "a rank-1 scale would broadcast a rank-0 tensor to rank 1")

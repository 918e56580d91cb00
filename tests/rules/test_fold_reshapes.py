"""fold_reshapes: Reshape(Reshape(x, s1), s2) -> Reshape(x, s2) when s2 copies no dim."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper
from support.models import (
    assert_no_change,
    assert_same_outputs,
    assert_second_run_changes_nothing,
    model_from_text,
    op_types,
)

import graphopt

RULE = "fold_reshapes"


def gpt2_heads(outer: str = "[2] flat = {-1, 64}", attrs: str = "", extra: str = "",
               outputs: str = "float[N,64] y", merged: str = "0, 0, -1") -> onnx.ModelProto:
    """GPT-2's merge of the heads, view(b, s, 64), then the projection's flattening."""
    return model_from_text(f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[B,S,4,16] t) => ({outputs})
          <int64[3] merged = {{{merged}}}, int64{outer}> {{
          m = Reshape(t, merged)
          y = Reshape {attrs} (m, flat)
          {extra}
        }}""")


def feeds(*sizes):
    rng = np.random.default_rng(0)
    return [{"t": rng.standard_normal((b, s, 4, 16)).astype(np.float32)} for b, s in sizes]


def test_the_second_view_decides_alone():
    model = gpt2_heads()
    out, report = graphopt.optimize(model, [RULE])
    assert op_types(out) == ["Reshape"] and list(out.graph.node[0].input)[0] == "t"
    target = {t.name: numpy_helper.to_array(t) for t in out.graph.initializer}[
        out.graph.node[0].input[1]]
    assert target.tolist() == [-1, 64]
    assert report.rules[RULE].rewrites == 1
    onnx.checker.check_model(out, full_check=True)
    for f in feeds((1, 1), (2, 5)):
        assert_same_outputs(model, out, f, atol=0, rtol=0)
    assert_second_run_changes_nothing(out, [RULE])


def test_a_zero_that_copies_the_inner_results_dim_stays():
    # m is [B*S*4, 16]; the 0 copies that B*S*4, which Reshape(t, [0, 2, 8]) would take
    # from t instead (B)
    model = model_from_text("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[B,S,4,16] t) => (float[N,2,8] y)
          <int64[2] rows = {-1, 16}, int64[3] split = {0, 2, 8}> {
          m = Reshape(t, rows)
          y = Reshape(m, split)
        }""")
    assert_no_change(model, [RULE])


def test_with_allowzero_a_zero_is_a_size_and_the_pair_folds():
    # (an empty batch: a -1 next to a 0-sized dim is an error, so the inner view says 64)
    model = gpt2_heads("[3] flat = {0, 7, 64}", "<allowzero = 1>", outputs="float[0,7,64] y",
                       merged="0, 0, 64")
    out, _ = graphopt.optimize(model, [RULE])
    assert op_types(out) == ["Reshape"]
    assert out.graph.node[0].attribute[0].name == "allowzero"
    empty = {"t": np.zeros((0, 7, 4, 16), np.float32)}
    assert_same_outputs(model, out, empty, atol=0, rtol=0)


@pytest.mark.parametrize("extra, outputs", [
    ("z = Neg(m)", "float[N,64] y, float[B,S,64] z"),  # the inner result is read elsewhere
])
def test_an_inner_reshape_with_other_readers_stays(extra, outputs):
    assert_no_change(gpt2_heads(extra=extra, outputs=outputs), [RULE])


def test_a_computed_outer_target_stays():
    model = model_from_text("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[B,S,4,16] t, int64[2] flat) => (float[?,?] y) <int64[3] merged = {0, 0, -1}> {
          m = Reshape(t, merged)
          y = Reshape(m, flat)
        }""")
    assert_no_change(model, [RULE])


def test_level_1_includes_it():
    assert RULE in {r.name for r in graphopt.select_rules(level=1)}

"""remove_noop_reshape: a Reshape to its input's own shape, entry by entry, goes."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper
from support.models import (
    assert_no_change,
    assert_same_outputs,
    assert_second_run_changes_nothing,
    model_from_text,
    op_types,
)

import graphopt

PASS = "remove_noop_reshape"


def view(target: str, attrs: str = "", outputs: str = "float[B,4,S,16] y") -> str:
    """Falcon's query.reshape(b, heads, s, d) of a Transpose that already has that shape;
    ``target`` lists the Concat's parts (ub, un: the batch and sequence sizes)."""
    return f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[B,S,4,16] q) => ({outputs})
          <int64 i0 = {{0}}, int64 i1 = {{1}}, int64[1] ax = {{0}}, int64[1] heads = {{4}},
           int64[1] d = {{16}}, int64[1] zero = {{0}}, int64[1] minus = {{-1}}> {{
          t = Transpose <perm = [0, 2, 1, 3]> (q)
          s = Shape(q)
          b = Gather(s, i0)
          n = Gather(s, i1)
          ub = Unsqueeze(b, ax)
          un = Unsqueeze(n, ax)
          c = Concat <axis = 0> ({target})
          r = Reshape {attrs} (t, c)
          y = Neg(r)
        }}"""


def feeds(*sizes):
    rng = np.random.default_rng(0)
    return [{"q": rng.standard_normal((b, s, 4, 16)).astype(np.float32)} for b, s in sizes]


@pytest.mark.parametrize("target", ["ub, heads, un, d", "zero, heads, un, d"])
def test_a_view_to_the_shape_the_tensor_has_goes(target):
    model = model_from_text(view(target))
    out, report = graphopt.optimize(model, [PASS])
    assert "Reshape" not in op_types(out) and "Concat" not in op_types(out)
    (neg,) = [n for n in out.graph.node if n.op_type == "Neg"]
    assert list(neg.input) == ["t"]
    assert report.rules[PASS].rewrites == 1
    onnx.checker.check_model(out, full_check=True)
    for f in feeds((1, 1), (2, 5), (3, 1)):
        assert_same_outputs(model, out, f, atol=0, rtol=0)
    assert_second_run_changes_nothing(out, [PASS])


@pytest.mark.parametrize("target, outputs", [
    ("un, heads, ub, d", "float[?,4,?,16] y"),  # the sizes swapped: a reshape if B != S
    ("ub, heads, minus", "float[?,4,?] y"),      # a rank change
    ("ub, heads, un, minus", "float[?,4,?,?] y"),  # -1 is the element count's to decide
])
def test_a_view_that_may_change_the_shape_stays(target, outputs):
    assert_no_change(model_from_text(view(target, outputs=outputs)), [PASS])


def test_with_allowzero_a_zero_is_a_size():
    model = model_from_text(view("zero, heads, un, d", "<allowzero = 1>",
                                 "float[?,4,?,16] y"))
    assert_no_change(model, [PASS])


def test_a_view_writing_a_graph_output_stays():
    text = view("ub, heads, un, d").replace("r = Reshape", "y = Reshape") \
        .replace("y = Neg(r)", "")
    model = model_from_text(text)
    assert_no_change(model, [PASS])


def test_a_view_a_subgraph_reads_by_name_stays():
    model = model_from_text(view("ub, heads, un, d"))
    branch = helper.make_graph(
        [helper.make_node("Abs", ["r"], ["o"])], "then", [],
        [helper.make_tensor_value_info("o", onnx.TensorProto.FLOAT, ["B", 4, "S", 16])])
    other = helper.make_graph(
        [helper.make_node("Neg", ["r"], ["e"])], "else", [],
        [helper.make_tensor_value_info("e", onnx.TensorProto.FLOAT, ["B", 4, "S", 16])])
    model.graph.input.append(helper.make_tensor_value_info("cond", onnx.TensorProto.BOOL, []))
    model.graph.node.append(helper.make_node("If", ["cond"], ["z"], then_branch=branch,
                                             else_branch=other))
    model.graph.output.append(helper.make_tensor_value_info("z", onnx.TensorProto.FLOAT,
                                                           ["B", 4, "S", 16]))
    onnx.checker.check_model(model)
    assert_no_change(model, [PASS])


def test_level_1_includes_it():
    assert PASS in {r.name for r in graphopt.select_rules(level=1)}

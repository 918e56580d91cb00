"""remove_noop_cast: a Cast to the element type its input already has goes."""
from __future__ import annotations

import numpy as np
import onnx
from support.models import (
    assert_no_change,
    assert_same_outputs,
    assert_second_run_changes_nothing,
    model_from_text,
    op_types,
)

import graphopt

RULE = "remove_noop_cast"


def test_float_to_float_and_int_to_int_casts_go():
    # Falcon's softmax .to(float32) and the position ids cast to int64
    model = model_from_text("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2,3] x, int64[3] i) => (float[2,3] y, int64[3] j) {
          s = Softmax(x)
          c = Cast <to = 1> (s)
          y = Neg(c)
          k = Cast <to = 7> (i)
          j = Abs(k)
        }""")
    out, report = graphopt.optimize(model, [RULE])
    assert op_types(out) == ["Softmax", "Neg", "Abs"]
    assert list(out.graph.node[1].input) == ["s"] and list(out.graph.node[2].input) == ["i"]
    assert report.rules[RULE].rewrites == 2
    feeds = {"x": np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32),
             "i": np.array([-3, 0, 7], np.int64)}
    assert_same_outputs(model, out, feeds, atol=0, rtol=0)
    assert_second_run_changes_nothing(out, [RULE])


def test_a_cast_that_converts_stays():
    model = model_from_text("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[3] x) => (float[3] y) {
          c = Cast <to = 7> (x)
          d = Cast <to = 1> (c)
          y = Neg(d)
        }""")
    assert_no_change(model, [RULE])


def test_a_cast_of_a_tensor_of_unknown_type_stays():
    # a custom op's output type is unknown to ONNX inference: the Cast may convert
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Op", ["a"], ["x"], domain="my.domain"),
         onnx.helper.make_node("Cast", ["x"], ["c"], to=onnx.TensorProto.FLOAT),
         onnx.helper.make_node("Neg", ["c"], ["y"])], "g",
        [onnx.helper.make_tensor_value_info("a", onnx.TensorProto.FLOAT, [3])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [3])])
    model = onnx.helper.make_model(graph, opset_imports=[
        onnx.helper.make_opsetid("", 17), onnx.helper.make_opsetid("my.domain", 1)])
    assert_no_change(model, [RULE])


def test_a_cast_writing_a_graph_output_leaves_an_identity_with_the_name():
    model = model_from_text("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[3] x) => (float[3] y) {
          y = Cast <to = 1> (x)
        }""")
    out, _ = graphopt.optimize(model, [RULE])
    assert op_types(out) == ["Identity"] and out.graph.node[0].output[0] == "y"
    assert_same_outputs(model, out, atol=0, rtol=0)


def test_level_1_includes_it():
    assert RULE in {r.name for r in graphopt.select_rules(level=1)}

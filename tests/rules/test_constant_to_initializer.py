"""constant_to_initializer: Constant nodes -> initializers of the same name and value."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper
from support.models import (
    assert_no_change,
    assert_same_outputs,
    assert_second_run_changes_nothing,
    model_from_text,
    op_types,
    run_ort,
)

import graphopt

PASS = "constant_to_initializer"


def run(model):
    return graphopt.optimize(model, [PASS])


def initializers(model) -> dict:
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


def test_every_kind_of_constant_becomes_an_initializer_with_its_name_and_value():
    model = model_from_text("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2,3] x) => (float[2,3] y) {
          t = Constant <value = float[3] {1.0, -2.0, 0.5}> ()
          f = Constant <value_float = 2.5> ()
          fs = Constant <value_floats = [1.0, 2.0, 3.0]> ()
          i = Constant <value_int = 3> ()
          ints = Constant <value_ints = [2, 3]> ()
          a = Mul(x, t)
          b = Add(a, f)
          c = Sub(b, fs)
          fi = Cast <to = 1> (i)
          d = Div(c, fi)
          y = Reshape(d, ints)
        }""")
    out, report = run(model)
    assert op_types(out) == ["Mul", "Add", "Sub", "Cast", "Div", "Reshape"]
    found = initializers(out)
    np.testing.assert_array_equal(found["t"], np.array([1.0, -2.0, 0.5], np.float32))
    assert found["f"].dtype == np.float32 and found["f"].shape == () and found["f"] == 2.5
    assert found["fs"].dtype == np.float32 and found["fs"].tolist() == [1.0, 2.0, 3.0]
    assert found["i"].dtype == np.int64 and found["i"].shape == () and found["i"] == 3
    assert found["ints"].dtype == np.int64 and found["ints"].tolist() == [2, 3]
    assert report.rules[PASS].rewrites == 5
    onnx.checker.check_model(out, full_check=True)
    assert_same_outputs(model, out, atol=0, rtol=0)
    assert_second_run_changes_nothing(out, [PASS])


def test_string_constants_become_string_initializers():
    model = model_from_text("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (string[2] x) => (string[4] y) {
          s = Constant <value_strings = ["a", "b"]> ()
          y = Concat <axis = 0> (x, s)
        }""")
    out, _ = run(model)
    assert op_types(out) == ["Concat"]
    assert initializers(out)["s"].tolist() == ["a", "b"]
    feeds = {"x": np.array(["c", "d"], dtype=object)}
    assert run_ort(out, feeds)[0].tolist() == run_ort(model, feeds)[0].tolist() == \
        ["c", "d", "a", "b"]


def test_a_constant_that_is_a_graph_output_stays():
    # an initializer is not a node: the output would have no producer
    model = model_from_text("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2] x) => (float[2] y, float[2] k) {
          k = Constant <value = float[2] {1.0, 2.0}> ()
          y = Add(x, k)
        }""")
    assert_no_change(model, [PASS])


def test_a_constant_nothing_reads_goes_without_an_initializer():
    model = model_from_text("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2] x) => (float[2] y) {
          unused = Constant <value = float[2] {1.0, 2.0}> ()
          y = Neg(x)
        }""")
    out, _ = run(model)
    assert op_types(out) == ["Neg"] and not out.graph.initializer


def test_constant_read_by_a_subgraph_and_constant_inside_one():
    """A main-graph Constant read by an If branch becomes a main-graph initializer (visible to
    the branch); a Constant inside the branch becomes the branch's initializer."""
    then_branch = helper.make_graph(
        [helper.make_node("Constant", [], ["two"],
                          value=numpy_helper.from_array(np.array([2.0, 2.0], np.float32))),
         helper.make_node("Mul", ["k", "two"], ["t"])], "then", [],
        [helper.make_tensor_value_info("t", onnx.TensorProto.FLOAT, [2])])
    else_branch = helper.make_graph(
        [helper.make_node("Neg", ["k"], ["e"])], "else", [],
        [helper.make_tensor_value_info("e", onnx.TensorProto.FLOAT, [2])])
    graph = helper.make_graph(
        [helper.make_node("Constant", [], ["k"],
                          value=numpy_helper.from_array(np.array([1.0, 3.0], np.float32))),
         helper.make_node("If", ["c"], ["r"], then_branch=then_branch, else_branch=else_branch),
         helper.make_node("Add", ["x", "r"], ["y"])],
        "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2]),
              helper.make_tensor_value_info("c", onnx.TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    out, report = run(model)
    assert op_types(out) == ["If", "Add"]
    assert list(initializers(out)) == ["k"]
    (branch,) = [a.g for a in out.graph.node[0].attribute if a.name == "then_branch"]
    assert [n.op_type for n in branch.node] == ["Mul"]
    assert [t.name for t in branch.initializer] == ["two"]
    assert report.rules[PASS].rewrites == 2
    onnx.checker.check_model(out, full_check=True)
    for c in (True, False):
        feeds = {"x": np.array([0.5, -1.0], np.float32), "c": np.array(c)}
        np.testing.assert_array_equal(run_ort(out, feeds)[0], run_ort(model, feeds)[0])


def test_sparse_constant_stays():
    sparse = helper.make_sparse_tensor(
        numpy_helper.from_array(np.array([5.0], np.float32), "v"),
        numpy_helper.from_array(np.array([1], np.int64), "i"), [3])
    graph = helper.make_graph(
        [helper.make_node("Constant", [], ["k"], sparse_value=sparse),
         helper.make_node("Add", ["x", "k"], ["y"])], "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [3])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    assert_no_change(model, [PASS])


def test_below_ir_version_4_an_initializer_must_be_an_input_so_nothing_changes():
    model = model_from_text("""
        <ir_version: 3, opset_import: ["" : 8]>
        g (float[2] x) => (float[2] y) {
          k = Constant <value = float[2] {1.0, 2.0}> ()
          y = Add(x, k)
        }""")
    assert_no_change(model, [PASS])


def test_level_1_includes_it_and_later_rules_read_the_initializers():
    model = model_from_text("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2,6,4] x) => (float[2,4,4] y) {
          s = Constant <value = int64[1] {0}> ()
          e = Constant <value = int64[1] {4}> ()
          ax = Constant <value = int64[1] {1}> ()
          y = Slice(x, s, e, ax)
        }""")
    out, report = graphopt.optimize(model, level=1)
    assert op_types(out) == ["Slice"]
    assert set(initializers(out)) == {"s", "e", "ax"}
    assert report.rules[PASS].rewrites == 3
    assert_same_outputs(model, out, atol=0, rtol=0)

"""eliminate_common_subexpressions: identical computations merged, unread nodes removed."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
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

PASS = "eliminate_common_subexpressions"


def run(model):
    return graphopt.optimize(model, [PASS])


def test_the_shape_arithmetic_two_layers_repeat_is_computed_once():
    # each layer reads the batch size off x again, with axes constants of its own
    model = model_from_text("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[B,S,4] x) => (float[B,S,2,2] y, float[B,S,2,2] z)
          <int64 i0 = {0}, int64 j0 = {0}, int64[1] a0 = {0}, int64[1] b0 = {0},
           int64[1] s = {-1}, int64[2] hd = {2, 2}, int64[1] s2 = {-1}, int64[2] hd2 = {2, 2}> {
          sh1 = Shape(x)
          n1 = Gather <axis = 0> (sh1, i0)
          u1 = Unsqueeze(n1, a0)
          c1 = Concat <axis = 0> (u1, s, hd)
          y = Reshape(x, c1)
          sh2 = Shape(x)
          n2 = Gather(sh2, j0)
          u2 = Unsqueeze(n2, b0)
          c2 = Concat <axis = 0> (u2, s2, hd2)
          r = Reshape(x, c2)
          z = Neg(r)
        }""")
    out, report = run(model)
    # Gather's axis=0 and the left-out axis (default 0) agree, the equal constants too, and
    # once the shapes are one tensor the two Reshapes are the same node as well
    assert op_types(out) == ["Shape", "Gather", "Unsqueeze", "Concat", "Reshape", "Neg"]
    assert report.rules[PASS].rewrites == 5
    assert list(out.graph.node[4].input) == ["x", "c1"]
    assert list(out.graph.node[5].input) == ["y"]
    # the duplicate constants went with the nodes that read them
    assert {t.name for t in out.graph.initializer} == {"i0", "a0", "s", "hd"}
    onnx.checker.check_model(out, full_check=True)
    feeds = {"x": np.random.default_rng(0).standard_normal((3, 5, 4)).astype(np.float32)}
    assert_same_outputs(model, out, feeds, atol=0, rtol=0)
    assert_second_run_changes_nothing(out, [PASS])


def test_commutative_inputs_in_either_order_merge_and_others_do_not():
    model = model_from_text("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[3] a, float[3] b) => (float[3] y, float[3] z) {
          p = Add(a, b)
          q = Add(b, a)
          d1 = Sub(a, b)
          d2 = Sub(b, a)
          y = Mul(p, d1)
          z = Mul(q, d2)
        }""")
    out, _ = run(model)
    assert op_types(out) == ["Add", "Sub", "Sub", "Mul", "Mul"]
    assert list(out.graph.node[4].input) == ["p", "d2"]
    assert_same_outputs(model, out, atol=0, rtol=0)


def test_constants_must_match_bit_for_bit():
    # 0.0 and -0.0 are equal numbers but different values (1 / x tells them apart)
    model = model_from_text("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2] x) => (float[2] y, float[2] z) <float p = {0.0}, float n = {-0.0}> {
          y = Add(x, p)
          z = Add(x, n)
        }""")
    assert_no_change(model, [PASS])


def test_different_attributes_do_not_merge():
    model = model_from_text("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2,3] x) => (float[2,3] y, float[2,3] z) {
          y = Softmax <axis = 0> (x)
          z = Softmax <axis = 1> (x)
        }""")
    assert_no_change(model, [PASS])


@pytest.mark.parametrize("nodes", [
    "a = RandomNormalLike(x)\n b = RandomNormalLike(x)",
    "a = RandomUniformLike <seed = 1.0> (x)\n b = RandomUniformLike <seed = 1.0> (x)",
    "a, ma = Dropout(x, ratio, train)\n b, mb = Dropout(x, ratio, train)",
])
def test_random_nodes_are_never_merged(nodes):
    """Each draws anew: merging two would make them draw the same numbers."""
    model = model_from_text(f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[64] x) => (float[64] y) <float ratio = {{0.5}}, bool train = {{1}}> {{
          {nodes}
          y = Sub(a, b)
        }}""")
    assert_no_change(model, [PASS])
    if "seed" not in nodes:  # (a seed may make two nodes draw alike: merged or not)
        y = run_ort(model, {"x": np.ones(64, np.float32)})[0]
        assert np.any(y != 0)  # the two draws differ


def test_a_duplicate_that_writes_a_graph_output_keeps_its_name_and_node():
    model = model_from_text("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2] x) => (float[2] y, float[2] z) {
          y = Neg(x)
          z = Neg(x)
        }""")
    assert_no_change(model, [PASS])


def test_the_earlier_node_may_write_a_graph_output_and_feed_the_later_readers():
    model = model_from_text("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2] x) => (float[2] y, float[2] z) {
          y = Neg(x)
          n = Neg(x)
          z = Abs(n)
        }""")
    out, _ = run(model)
    assert op_types(out) == ["Neg", "Abs"] and list(out.graph.node[1].input) == ["y"]
    assert [o.name for o in out.graph.output] == ["y", "z"]
    assert_same_outputs(model, out, atol=0, rtol=0)


def _branches(reads: str):
    then_branch = helper.make_graph(
        [helper.make_node("Abs", [reads], ["t"])], "then", [],
        [helper.make_tensor_value_info("t", onnx.TensorProto.FLOAT, [2])])
    else_branch = helper.make_graph(
        [helper.make_node("Neg", [reads], ["e"])], "else", [],
        [helper.make_tensor_value_info("e", onnx.TensorProto.FLOAT, [2])])
    return {"then_branch": then_branch, "else_branch": else_branch}


def test_a_duplicate_a_subgraph_reads_by_name_stays():
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["a"]),
         helper.make_node("Relu", ["x"], ["b"]),
         helper.make_node("If", ["c"], ["r"], **_branches("b")),
         helper.make_node("Add", ["a", "r"], ["y"])],
        "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2]),
              helper.make_tensor_value_info("c", onnx.TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    assert_no_change(model, [PASS])


def test_nodes_with_subgraphs_are_not_merged():
    graph = helper.make_graph(
        [helper.make_node("If", ["c"], ["r1"], **_branches("x")),
         helper.make_node("If", ["c"], ["r2"], **_branches("x")),
         helper.make_node("Add", ["r1", "r2"], ["y"])],
        "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2]),
              helper.make_tensor_value_info("c", onnx.TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    assert_no_change(model, [PASS])


def test_identical_nodes_inside_a_subgraph_merge_there():
    then_branch = helper.make_graph(
        [helper.make_node("Abs", ["x"], ["t1"]), helper.make_node("Abs", ["x"], ["t2"]),
         helper.make_node("Add", ["t1", "t2"], ["t"])], "then", [],
        [helper.make_tensor_value_info("t", onnx.TensorProto.FLOAT, [2])])
    else_branch = helper.make_graph(
        [helper.make_node("Neg", ["x"], ["e"])], "else", [],
        [helper.make_tensor_value_info("e", onnx.TensorProto.FLOAT, [2])])
    graph = helper.make_graph(
        [helper.make_node("If", ["c"], ["y"], then_branch=then_branch,
                          else_branch=else_branch)],
        "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2]),
              helper.make_tensor_value_info("c", onnx.TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    out, _ = run(model)
    (branch,) = [a.g for a in out.graph.node[0].attribute if a.name == "then_branch"]
    assert [n.op_type for n in branch.node] == ["Abs", "Add"]
    assert list(branch.node[1].input) == ["t1", "t1"]
    feeds = {"x": np.array([-1.0, 2.0], np.float32), "c": np.array(True)}
    np.testing.assert_array_equal(run_ort(out, feeds)[0], [2.0, 4.0])


def test_dead_nodes_go_with_the_initializers_only_they_read():
    model = model_from_text("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2] x) => (float[2] y) <float[2] w = {1.0, 2.0}, float[2] v = {3.0, 4.0}> {
          dead1 = Mul(x, w)
          dead2 = Relu(dead1)
          y = Add(x, v)
        }""")
    out, report = run(model)
    assert op_types(out) == ["Add"]
    assert [t.name for t in out.graph.initializer] == ["v"]
    assert report.rules[PASS].rewrites == 2
    assert_same_outputs(model, out, atol=0, rtol=0)
    assert_second_run_changes_nothing(out, [PASS])


def test_unread_nodes_of_other_domains_stay():
    # a custom op (or ONNX Runtime's YieldOp) may do more than compute its outputs
    graph = helper.make_graph(
        [helper.make_node("Log", ["x"], ["l"], domain="my.domain"),
         helper.make_node("YieldOp", ["x"], ["g"], domain="com.microsoft",
                          full_shape_outputs=[0]),
         helper.make_node("Neg", ["x"], ["y"])],
        "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2])])
    model = helper.make_model(graph, opset_imports=[
        helper.make_opsetid("", 17), helper.make_opsetid("my.domain", 1),
        helper.make_opsetid("com.microsoft", 1)])
    assert_no_change(model, [PASS])


def test_level_1_includes_it():
    assert PASS in {r.name for r in graphopt.select_rules(level=1)}


def test_large_equal_constants_are_compared_by_name():
    # above 4096 elements a constant is not read to compare: two copies stay two inputs
    w1 = numpy_helper.from_array(np.ones(4097, np.float32), "w1")
    w2 = numpy_helper.from_array(np.ones(4097, np.float32), "w2")
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "w1"], ["a"]), helper.make_node("Add", ["x", "w2"], ["b"]),
         helper.make_node("Sub", ["a", "b"], ["y"])], "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [4097])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [4097])],
        initializer=[w1, w2])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    assert_no_change(model, [PASS])

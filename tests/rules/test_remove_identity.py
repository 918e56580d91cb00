"""remove_identity: Identity nodes go, their readers read the input; output names stay."""
from __future__ import annotations

import onnx
from onnx import helper
from support.models import (
    assert_no_change,
    assert_same_outputs,
    assert_second_run_changes_nothing,
    fused,
    fused_attrs,
    model_from_text,
    op_types,
)

import graphopt

PASS = "remove_identity"


def test_inner_identity_goes_and_its_readers_read_the_input():
    model = model_from_text("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2,3] x) => (float[2,3] y) {
          a = Relu(x)
          b = Identity(a)
          c = Identity(b)
          y = Add(c, b)
        }""")
    out, report = graphopt.optimize(model, [PASS])
    assert op_types(out) == ["Relu", "Add"]
    assert list(out.graph.node[1].input) == ["a", "a"]
    assert report.rules[PASS].rewrites == 2
    assert_same_outputs(model, out, atol=0, rtol=0)
    assert_second_run_changes_nothing(out, [PASS])


def test_graph_output_name_is_kept_by_renaming_the_producer_output():
    model = model_from_text("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2,3] x) => (float[2,3] y, float[2,3] z) {
          a = Relu(x)
          y = Identity(a)
          z = Neg(a)
        }""")
    out, _ = graphopt.optimize(model, [PASS])
    assert op_types(out) == ["Relu", "Neg"]
    assert list(out.graph.node[0].output) == ["y"] and list(out.graph.node[1].input) == ["y"]
    assert [o.name for o in out.graph.output] == ["y", "z"]
    onnx.checker.check_model(out, full_check=True)
    assert_same_outputs(model, out, atol=0, rtol=0)
    assert_second_run_changes_nothing(out, [PASS])


def test_identity_between_two_names_the_graph_owns_stays():
    # y = x (a graph input), z = y and w = a graph output: there is no node to rename
    model = model_from_text("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2,3] x) => (float[2,3] y, float[2,3] a, float[2,3] b) {
          y = Identity(x)
          a = Relu(x)
          b = Identity(a)
        }""")
    report = assert_no_change(model, [PASS])
    assert report.rules[PASS].rewrites == 0


def test_identity_read_by_a_subgraph_stays():
    then_branch = helper.make_graph(
        [helper.make_node("Neg", ["b"], ["t"])], "then", [],
        [helper.make_tensor_value_info("t", onnx.TensorProto.FLOAT, [2])])
    else_branch = helper.make_graph(
        [helper.make_node("Abs", ["b"], ["e"])], "else", [],
        [helper.make_tensor_value_info("e", onnx.TensorProto.FLOAT, [2])])
    graph = helper.make_graph(
        [helper.make_node("Identity", ["x"], ["b"], name="id"),
         helper.make_node("If", ["c"], ["y"], then_branch=then_branch,
                          else_branch=else_branch)],
        "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2]),
              helper.make_tensor_value_info("c", onnx.TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    assert_no_change(model, [PASS])


def test_identity_no_longer_hides_a_scale_from_the_fused_matmul():
    # ORT's training graphs: MatMul -> Identity -> Mul(0.125), a backward scale fusion
    model = model_from_text("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4,8] a, float[8,4] b) => (float[4,4] y) <float s = {0.125}> {
          p = MatMul(a, b)
          q = Identity(p)
          y = Mul(q, s)
        }""")
    out, report = graphopt.optimize(model, level=2)
    assert op_types(out) == ["FusedMatMul"]
    assert fused_attrs(fused(out)[0])["alpha"] == 0.125
    assert report.rules[PASS].rewrites == 1
    assert_same_outputs(model, out)
    assert_second_run_changes_nothing(out, [PASS, "matmul_scale_to_fused_matmul"])


def test_level_1_includes_it():
    assert PASS in {r.name for r in graphopt.select_rules(level=1)}


# -- the paths the fixtures above never take ---------------------------------------------------
def test_an_identity_between_two_graph_outputs_stays():
    model = model_from_text("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2,3] x) => (float[2,3] a, float[2,3] y) {
          a = Relu(x)
          y = Identity(a)
        }""")
    assert_no_change(model, [PASS])


def test_an_identity_of_an_initializer_into_a_graph_output_stays():
    model = model_from_text("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2] x) => (float[2] y, float[2] z) <float[2] w = {1.0, 2.0}> {
          y = Identity(w)
          z = Add(x, w)
        }""")
    assert_no_change(model, [PASS])


def _if_reading(name: str, identity: onnx.NodeProto, outputs) -> onnx.ModelProto:
    """x -> Relu -> r, the Identity given, and an If whose branches read ``name``."""
    then_branch = helper.make_graph(
        [helper.make_node("Neg", [name], ["t"])], "then", [],
        [helper.make_tensor_value_info("t", onnx.TensorProto.FLOAT, [2])])
    else_branch = helper.make_graph(
        [helper.make_node("Abs", [name], ["e"])], "else", [],
        [helper.make_tensor_value_info("e", onnx.TensorProto.FLOAT, [2])])
    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["r"]), identity,
         helper.make_node("If", ["c"], ["o"], then_branch=then_branch,
                          else_branch=else_branch)],
        "g", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2]),
              helper.make_tensor_value_info("c", onnx.TensorProto.BOOL, [])],
        [helper.make_tensor_value_info(n, onnx.TensorProto.FLOAT, [2]) for n in outputs])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    return model


def test_an_identity_into_a_graph_output_whose_input_a_subgraph_reads_stays():
    # renaming r to y would leave the branches reading a name nobody writes
    model = _if_reading("r", helper.make_node("Identity", ["r"], ["y"]), ["o", "y"])
    assert_no_change(model, [PASS])


def test_an_inner_identity_whose_output_a_subgraph_reads_stays():
    model = _if_reading("b", helper.make_node("Identity", ["r"], ["b"]), ["o"])
    assert_no_change(model, [PASS])


def test_only_the_output_the_identity_reads_is_renamed():
    model = model_from_text("""
        <ir_version: 8, opset_import: ["" : 18]>
        g (float[4,3] x) => (float[2,3] y, float[2,3] z) {
          first, second = Split <axis = 0, num_outputs = 2> (x)
          y = Identity(first)
          z = Neg(second)
        }""")
    out, report = graphopt.optimize(model, [PASS])
    assert op_types(out) == ["Split", "Neg"] and report.rules[PASS].rewrites == 1
    assert list(out.graph.node[0].output) == ["y", "second"]
    assert_same_outputs(model, out, atol=0, rtol=0)


def test_a_graph_output_keeps_its_declared_type_and_an_untyped_one_gets_the_inputs():
    model = model_from_text("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2,3] x) => (float[N,3] y) {
          a = Relu(x)
          y = Identity(a)
        }""")
    model.graph.value_info.append(helper.make_tensor_value_info("a", onnx.TensorProto.FLOAT,
                                                                [2, 3]))
    out, _ = graphopt.optimize(model, [PASS])
    (declared,) = out.graph.output
    assert [d.dim_param or d.dim_value for d in declared.type.tensor_type.shape.dim] == ["N", 3]

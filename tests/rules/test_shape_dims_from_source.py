"""shape_dims_from_source: Gather(Shape(t), i) -> Gather(Shape(s), k) where dim i of t is
provably dim k of the earlier s (rules/_dims.py)."""
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
    run_ort,
)

import graphopt

PASS = "shape_dims_from_source"
CSE = "eliminate_common_subexpressions"
SIZES = [(1, 1), (2, 3), (3, 1), (1, 4)]

# Two "layers", each reading the batch and sequence sizes off its own tensor: through
# MatMul, a broadcast Add of a bias, Relu, a Transpose and a Split piece, and a Shape with
# start=1 (opset 15).
LAYERS = """
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[B,S,8] x) => (float[B,S,2,4] y, float[S,B,4] z)
      <float[8,8] w = {WEIGHTS}, float[8] bias = {1, 2, 3, 4, 5, 6, 7, 8},
       int64 i0 = {0}, int64 i1 = {1}, int64 i2 = {2}, int64[1] ax = {0},
       int64[2] hd = {2, 4}, int64[2] halves = {4, 4}, int64[1] four = {4}> {
      h = MatMul(x, w)
      hb = Add(h, bias)
      r = Relu(hb)
      s1 = Shape(r)
      b1 = Gather(s1, i0)
      n1 = Gather(s1, i1)
      ub1 = Unsqueeze(b1, ax)
      un1 = Unsqueeze(n1, ax)
      c1 = Concat <axis = 0> (ub1, un1, hd)
      y = Reshape(r, c1)
      t = Transpose <perm = [1, 0, 2]> (r)
      p, q = Split <axis = 2> (t, halves)
      s2 = Shape <start = 1> (p)
      b2 = Gather(s2, i0)
      s3 = Shape(q)
      n2 = Gather(s3, i0)
      ub2 = Unsqueeze(b2, ax)
      un2 = Unsqueeze(n2, ax)
      c2 = Concat <axis = 0> (un2, ub2, four)
      z = Reshape(q, c2)
    }""".replace("WEIGHTS", ", ".join(str(v) for v in np.linspace(-1, 1, 64).round(3)))


def sized_feeds(model, sizes=SIZES):
    rng = np.random.default_rng(0)
    return [{"x": rng.standard_normal((b, s, 8)).astype(np.float32)} for b, s in sizes]


def gathers(model) -> list[tuple[str, list]]:
    """(the tensor each Gather of a Shape reads the shape of, the indices)."""
    producers = {o: n for n in model.graph.node for o in n.output}
    values = {t.name: onnx.numpy_helper.to_array(t).reshape(-1).tolist()
              for t in model.graph.initializer}
    found = []
    for node in model.graph.node:
        shape = producers.get(node.input[0])
        if node.op_type == "Gather" and shape is not None and shape.op_type == "Shape":
            found.append((shape.input[0], values[node.input[1]]))
    return found


def test_every_layers_sizes_are_read_off_the_input():
    model = model_from_text(LAYERS)
    out, report = graphopt.optimize(model, [PASS, CSE])
    # every Gather now reads Shape(x); merged, the sizes are computed once
    assert gathers(out) == [("x", [0]), ("x", [1])]
    assert op_types(out).count("Shape") == 1 and op_types(out).count("Unsqueeze") == 2
    assert report.rules[PASS].rewrites == 4
    onnx.checker.check_model(out, full_check=True)
    for feeds in sized_feeds(model):
        assert_same_outputs(model, out, feeds, atol=0, rtol=0)
    assert_second_run_changes_nothing(out, [PASS, CSE])


def test_at_level_1_the_views_copy_the_dims_and_no_size_becomes_a_number():
    # fold_reshape_shape then writes each size as a 0 (copy x's dim there): nothing is left
    # of the shape arithmetic, and a symbolic size is never written as a number
    model = model_from_text(LAYERS)
    out, _ = graphopt.optimize(model, level=1)
    assert op_types(out) == ["MatMul", "Add", "Relu", "Reshape", "Transpose", "Split",
                             "Reshape"]
    values = {t.name: onnx.numpy_helper.to_array(t).tolist() for t in out.graph.initializer}
    targets = [values[n.input[1]] for n in out.graph.node if n.op_type == "Reshape"]
    assert targets == [[0, 0, 2, 4], [0, 0, 4]]
    for feeds in sized_feeds(model, [*SIZES, (5, 7)]):
        assert_same_outputs(model, out, feeds, atol=0, rtol=0)


def test_a_dimension_broadcast_against_an_unrelated_one_stays():
    # B and C are different symbols: either may be 1 at run time, so the sum's dim is not x's
    model = model_from_text("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[B,3] x, float[C,3] v) => (int64[1] y) <int64 i0 = {0}, int64[1] ax = {0}> {
          a = Add(x, v)
          s = Shape(a)
          b = Gather(s, i0)
          y = Unsqueeze(b, ax)
        }""")
    assert_no_change(model, [PASS])


def test_a_computed_reshape_entry_is_not_the_dimension_it_names_when_it_may_copy():
    """``Reshape(m [N, 8], [B, S, 8])`` (GPT-2's Conv1D view) writes dim 1 = S unless S is 0:
    a 0 entry copies the input's dim 1 (8) instead. With x of shape [0, 0, 8] the original
    graph says 8, so dim 1 of the view is not S, and the Gather stays."""
    model = model_from_text("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[B,S,8] x) => (int64[1] y)
          <int64[2] flat = {-1, 8}, int64 i0 = {0}, int64 i1 = {1}, int64[1] ax = {0},
           int64[1] eight = {8}> {
          m = Reshape(x, flat)
          s = Shape(x)
          b = Gather(s, i0)
          n = Gather(s, i1)
          ub = Unsqueeze(b, ax)
          un = Unsqueeze(n, ax)
          target = Concat <axis = 0> (ub, un, eight)
          v = Reshape(m, target)
          sv = Shape(v)
          d = Gather(sv, i1)
          y = Unsqueeze(d, ax)
        }""")
    assert run_ort(model, {"x": np.zeros((0, 0, 8), np.float32)})[0].tolist() == [8]
    assert_no_change(model, [PASS])


def test_a_subgraph_does_not_read_an_outer_tensor_it_did_not_read_before():
    # x's dim would do, but a new reader of x inside the branch is invisible to the outer
    # graph's index, so the Gather stays
    branch = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Shape", ["r"], ["s"]),
         helper.make_node("Gather", ["s", "i0"], ["b"])], "then", [],
        [helper.make_tensor_value_info("b", onnx.TensorProto.INT64, [])],
        initializer=[onnx.numpy_helper.from_array(np.array(0, np.int64), "i0")])
    other = helper.make_graph(
        [helper.make_node("Size", ["x"], ["e"])], "else", [],
        [helper.make_tensor_value_info("e", onnx.TensorProto.INT64, [])])
    graph = helper.make_graph(
        [helper.make_node("If", ["c"], ["y"], then_branch=branch, else_branch=other)], "g",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["B", 3]),
         helper.make_tensor_value_info("c", onnx.TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.INT64, [])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    assert_no_change(model, [PASS])


def test_a_gather_writing_a_graph_output_keeps_the_name():
    model = model_from_text("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[B,3] x) => (int64 b) <int64 i0 = {0}> {
          r = Relu(x)
          s = Shape(r)
          b = Gather(s, i0)
        }""")
    out, _ = graphopt.optimize(model, [PASS])
    assert gathers(out) == [("x", [0])] and out.graph.node[-1].output[0] == "b"
    assert [o.name for o in out.graph.output] == ["b"]
    assert_same_outputs(model, out, {"x": np.zeros((4, 3), np.float32)}, atol=0, rtol=0)


def test_level_1_includes_it():
    assert PASS in {r.name for r in graphopt.select_rules(level=1)}


# -- the paths the fixtures above never take ---------------------------------------------------
# r = Relu(x): its dims are x's; Gather(Shape(r), INDEX) is read off x instead
def _relu_reading(index_decl: str, *, shape_attrs: str = "", extra: str = "",
                  outputs: str = "int64[1] y", inputs: str = "float[B,S,8] x") -> str:
    return f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g ({inputs}) => ({outputs}) <{index_decl}, int64[1] flat = {{-1}}> {{
          {extra}
          r = Relu(x)
          s = Shape {shape_attrs} (r)
          b = Gather(s, i)
          y = Reshape(b, flat)
        }}"""


def test_an_existing_whole_shape_of_the_source_is_reused():
    model = model_from_text(_relu_reading("int64 i = {1}", extra="early = Shape(x)",
                                          outputs="int64[1] y, int64[3] early"))
    out, report = graphopt.optimize(model, [PASS])
    assert report.rules[PASS].rewrites == 1
    assert op_types(out).count("Shape") == 1 and gathers(out) == [("x", [1])]
    assert_same_outputs(model, out, feeds=sized_feeds(model)[1], atol=0, rtol=0)


@pytest.mark.parametrize("attrs", ["<start = 1>", "<end = 2>"])
def test_a_partial_shape_of_the_source_is_not_reused_as_the_whole_shape(attrs):
    model = model_from_text(_relu_reading("int64 i = {1}", extra=f"early = Shape {attrs} (x)",
                                          outputs="int64[1] y, int64[2] early"))
    out, report = graphopt.optimize(model, [PASS])
    assert report.rules[PASS].rewrites == 1
    assert op_types(out).count("Shape") == 2 and ("x", [1]) in gathers(out)
    assert_same_outputs(model, out, feeds=sized_feeds(model)[1], atol=0, rtol=0)


@pytest.mark.parametrize("index,shape_attrs,read", [
    ("int64[2] i = {0, 1}", "", [0, 1]),          # several dims at once
    ("int64 i = {-3}", "", [0]),                 # the most negative index
    ("int64 i = {-1}", "<start = 1, end = 2>", [1]),   # through start and end
    ("int64 i = {0}", "<end = -1>", [0]),
])
def test_indices_are_read_through_the_shapes_start_and_end(index, shape_attrs, read):
    outputs = "int64[2] y" if "[2]" in index else "int64[1] y"
    model = model_from_text(_relu_reading(index, shape_attrs=shape_attrs, outputs=outputs))
    out, report = graphopt.optimize(model, [PASS])
    assert report.rules[PASS].rewrites == 1 and gathers(out) == [("x", read)]
    assert_same_outputs(model, out, feeds=sized_feeds(model)[1], atol=0, rtol=0)


@pytest.mark.parametrize("index", [
    "int64 i = {3}",                        # one past the end: fails at run time, left so
    "int64 i = {-4}",                       # one before the start
    "int64[0] i = {}",                      # nothing picked
    "int64[2,1] i = {0, 1}",                # an index of rank 2
    "int64[65] i = {" + ", ".join(["0"] * 65) + "}",   # more values than are read
])
def test_indices_the_rule_does_not_take_leave_the_gather(index):
    outputs = "int64[65] y" if "[65]" in index else "int64[2] y" if "[2" in index \
        else "int64[0] y" if "[0]" in index else "int64[1] y"
    model = model_from_text(_relu_reading(index, outputs=outputs))
    assert_no_change(model, [PASS])


def test_a_tensor_of_unknown_rank_leaves_the_gather():
    model = model_from_text(_relu_reading("int64 i = {0}", inputs="float[3,4] x_in, int64[K] to",
                                          extra="x = Reshape(x_in, to)"))
    assert_no_change(model, [PASS])


def test_dims_from_two_different_tensors_are_not_read_off_one():
    model = model_from_text("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[B,S,8] a, float[8,N] w) => (int64[2] y) <int64[2] i = {0, 2}> {
          t = MatMul(a, w)
          s = Shape(t)
          y = Gather(s, i)
        }""")
    assert_no_change(model, [PASS])


def test_a_gather_the_rule_does_not_take_does_not_stop_the_ones_after_it():
    model = model_from_text("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[B,S,8] x, int64[3] v) => (int64 u, int64 y) <int64 i = {1}> {
          u = Gather(v, i)
          r = Relu(x)
          s = Shape(r)
          y = Gather(s, i)
        }""")
    out, report = graphopt.optimize(model, [PASS])
    assert report.rules[PASS].rewrites == 1 and gathers(out) == [("x", [1])]


def test_a_gather_of_something_else_than_a_shape_stays():
    # Gather(r2, 0) picks r2's first row: no dimension of anything
    model = model_from_text("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[B,S,8] x) => (float[S,8] y) <int64 i = {0}> {
          r1 = Relu(x)
          r2 = Relu(r1)
          y = Gather(r2, i)
        }""")
    assert_no_change(model, [PASS])

"""fold_shapes: Shape/Size of known dims, and Gather/Slice of static dims of a Shape ->
constants (and, with fold_constants, what is computed from them)."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper
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
from graphopt.ir import Model, type_dims

PASS = "fold_shapes"


def initializer(model, name):
    (t,) = [t for t in model.graph.initializer if t.name == name]
    return numpy_helper.to_array(t)


# HF's SDPA export: scale = 1/sqrt(sqrt(d)) from Shape(q), applied to q and to k^T
SDPA = """
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[B,2,S,8] q, float[B,2,S,8] k) => (float[B,2,S,S] y) {
      shape = Shape(q)
      start = Constant <value = int64[1] {-1}> ()
      end = Constant <value = int64[1] {9223372036854775807}> ()
      d = Slice(shape, start, end)
      df = Cast <to = 1> (d)
      sq = Sqrt(df)
      one = Constant <value = float[1] {1.0}> ()
      inv = Div(one, sq)
      s = Sqrt(inv)
      qs = Mul(q, s)
      kt = Transpose <perm = [0, 1, 3, 2]> (k)
      ks = Mul(kt, s)
      y = MatMul(qs, ks)
    }"""


def test_sdpa_scale_from_a_partly_symbolic_shape_folds_at_level_1():
    model = model_from_text(SDPA)
    out, report = graphopt.optimize(model, level=1)
    assert op_types(out) == ["Mul", "Transpose", "Mul", "MatMul"]
    np.testing.assert_allclose(initializer(out, "s"), [8 ** -0.25], rtol=1e-6)
    assert report.rules[PASS].rewrites == 1  # the Slice of the Shape; fold_constants the rest
    assert_same_outputs(model, out)
    assert_second_run_changes_nothing(out, [PASS, "fold_constants"])


def test_sdpa_scale_on_both_operands_becomes_one_fused_matmul_alpha():
    model = model_from_text(SDPA)
    out, _ = graphopt.optimize(model, level=2)
    (node,) = fused(out)
    assert op_types(out) == ["FusedMatMul"]
    attrs = fused_attrs(node)
    assert np.isclose(attrs["alpha"], 1 / np.sqrt(8), rtol=1e-6) and attrs["transB"] == 1
    assert_same_outputs(model, out)


def test_symbolic_dim_stays():
    model = model_from_text("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[B,6] x) => (float[B,6] y) {
          shape = Shape(x)
          i = Constant <value = int64 {0}> ()
          b = Gather(shape, i)
          bf = Cast <to = 1> (b)
          y = Mul(x, bf)
        }""")
    report = assert_no_change(model, [PASS], explain=[PASS])
    assert report.rules[PASS].rewrites == 0


def test_fixed_axis_of_a_dynamic_tensor_gives_constant_split_bounds():
    # GPT-NeoX / MPT TorchScript chunk(3, -1) on a dynamic export: the bounds of the three
    # Slices come from Shape(qkv)[-1], a static axis; once folded the Split fusion fires.
    model = model_from_text("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[B,S,12] qkv) => (float[B,S,4] q, float[B,S,4] k, float[B,S,4] v) {
          shape = Shape(qkv)
          last = Constant <value = int64 {2}> ()
          n = Gather(shape, last)
          three = Constant <value = int64 {3}> ()
          part = Div(n, three)
          zero = Constant <value = int64[1] {0}> ()
          ax = Constant <value = int64[1] {-1}> ()
          p1 = Unsqueeze(part, zero)
          two = Constant <value = int64 {2}> ()
          twice = Mul(part, two)
          p2 = Unsqueeze(twice, zero)
          p3 = Unsqueeze(n, zero)
          q = Slice(qkv, zero, p1, ax)
          k = Slice(qkv, p1, p2, ax)
          v = Slice(qkv, p2, p3, ax)
        }""")
    out, report = graphopt.optimize(model, level=1)
    assert op_types(out) == ["Split"]
    assert initializer(out, out.graph.node[0].input[1]).tolist() == [4, 4, 4]
    assert report.rules[PASS].rewrites == 1
    assert_same_outputs(model, out, atol=0, rtol=0)
    assert_second_run_changes_nothing(out, [PASS, "fold_constants", "gather_slice_to_split"])


def test_shape_size_and_stepped_slice_of_static_dims():
    model = model_from_text("""
        <ir_version: 9, opset_import: ["" : 18]>
        g (float[2,3,5,7] x, float[N,3,5,7] z) => (int64[4] a, int64[2] b, int64 c, int64[2] d) {
          full = Shape(x)
          a = Identity(full)
          part = Shape <start = 1, end = -1> (x)
          b = Identity(part)
          size = Size(x)
          c = Identity(size)
          st = Constant <value = int64[1] {-1}> ()
          en = Constant <value = int64[1] {-100}> ()
          ax = Constant <value = int64[1] {0}> ()
          step = Constant <value = int64[1] {-2}> ()
          zshape = Shape(z)
          rev = Slice(zshape, st, en, ax, step)
          d = Identity(rev)
        }""")
    out, report = graphopt.optimize(model, [PASS])
    assert op_types(out) == ["Identity"] * 4
    assert initializer(out, "full").tolist() == [2, 3, 5, 7]
    assert initializer(out, "part").tolist() == [3, 5]
    assert initializer(out, "size").tolist() == 210
    assert initializer(out, "rev").tolist() == [7, 3]
    assert report.rules[PASS].rewrites == 4
    assert_same_outputs(model, out, atol=0, rtol=0)
    assert_second_run_changes_nothing(out, [PASS])


def test_out_of_range_index_and_graph_output_stay():
    model = model_from_text("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2,3] x, int64 i) => (int64[2] shape, int64 n) {
          shape = Shape(x)
          n = Gather(shape, i)
        }""")
    assert_no_change(model, [PASS])


def test_result_is_deterministic():
    model = model_from_text(SDPA)
    first, _ = graphopt.optimize(model, level=2)
    second, _ = graphopt.optimize(model, level=2)
    assert first.SerializeToString() == second.SerializeToString()
    onnx.checker.check_model(first)


def test_shapes_made_static_by_folded_constants_fold_in_the_same_run():
    # Reshape's shape is computed from Shape(x)[1:2] through a Neg, which ONNX inference
    # cannot see through: only once fold_shapes and then fold_constants have folded it is the
    # Reshape's output shape known. The pass re-infers, so one optimization gets it all.
    model = model_from_text("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[B,12] x) => (float[B,3,4] y) {
          sx = Shape(x)
          one = Constant <value = int64[1] {1}> ()
          two = Constant <value = int64[1] {2}> ()
          d = Slice(sx, one, two)
          nd = Neg(d)
          minus4 = Constant <value = int64[1] {-4}> ()
          q = Div(nd, minus4)
          rest = Constant <value = int64[1] {-1}> ()
          four = Constant <value = int64[1] {4}> ()
          shape = Concat <axis = 0> (rest, q, four)
          r = Reshape(x, shape)
          s = Shape(r)
          i = Constant <value = int64 {1}> ()
          g3 = Gather(s, i)
          f = Cast <to = 1> (g3)
          y = Mul(r, f)
        }""")
    out, _ = graphopt.optimize(model, level=1)
    assert op_types(out) == ["Reshape", "Mul"]
    assert_same_outputs(model, out, atol=0, rtol=0)
    assert_second_run_changes_nothing(out, [PASS, "fold_constants"])


def test_a_tensor_made_static_by_folded_bounds_is_split_in_the_same_run():
    # a = x[:, :Shape(x)[1] / 2]: a's width is known only once the bound is folded, after the
    # only Shape node is gone; the types are refined then too (found by tests/robustness)
    model = model_from_text("""
        <ir_version: 8, opset_import: ["" : 11]>
        g (float[B,12] x) => (float[B,3] p, float[B,3] q) {
          sx = Shape(x)
          one = Constant <value = int64 {1}> ()
          n = Gather(sx, one)
          two = Constant <value = int64 {2}> ()
          half = Div(n, two)
          end = Unsqueeze <axes = [0]> (half)
          zero = Constant <value = int64[1] {0}> ()
          ax = Constant <value = int64[1] {1}> ()
          a = Slice(x, zero, end, ax)
          three = Constant <value = int64[1] {3}> ()
          six = Constant <value = int64[1] {6}> ()
          p = Slice(a, zero, three, ax)
          q = Slice(a, three, six, ax)
        }""")
    out, _ = graphopt.optimize(model, level=1)
    assert "Split" in op_types(out)
    assert_same_outputs(model, out, atol=0, rtol=0)
    assert_second_run_changes_nothing(out, [PASS, "fold_constants", "gather_slice_to_split"])


def test_size_beyond_int64_stays():
    """Size of a [2**40, 2**40] tensor (2**80 elements) has no int64 value: np.prod would
    wrap it around to 0; the Size stays. A product that fits still folds."""
    model = model_from_text("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[1099511627776,1099511627776] x, float[3037000499,3037000499] y)
            => (int64 n, int64 m) {
          size = Size(x)
          n = Identity(size)
          fits = Size(y)
          m = Identity(fits)
        }""")
    out, report = graphopt.optimize(model, [PASS])
    assert sorted(op_types(out)) == ["Identity", "Identity", "Size"]
    assert initializer(out, "fits").tolist() == 3037000499 ** 2
    assert report.rules[PASS].rewrites == 1



def test_a_size_inference_lost_behind_a_contrib_op_is_found_at_its_origin():
    # ONNX inference knows no FusedMatMul: the Reshape of its product to a computed target
    # gets no dims from it. The target's last entry is the constant 4, so Shape(r)[2] is 4
    # (GPT-2's attention output view once the scale is fused).
    model = model_from_text("""
        <ir_version: 8, opset_import: ["" : 17, "com.microsoft" : 1]>
        g (float[B,S,8] a, float[8,8] w) => (float[B,N,4] y)
          <int64 i0 = {0}, int64 i2 = {2}, int64[1] ax = {0}, int64[2] tail = {-1, 4}> {
          p = com.microsoft.FusedMatMul <alpha = 0.5> (a, w)
          sp = Shape(p)
          b = Gather(sp, i0)
          ub = Unsqueeze(b, ax)
          target = Concat <axis = 0> (ub, tail)
          r = Reshape(p, target)
          sr = Shape(r)
          d = Gather(sr, i2)
          df = Cast <to = 1> (d)
          y = Mul(r, df)
        }""")
    assert Model(model).graph.static_shape("r")[2] is None  # not from inference
    out, report = graphopt.optimize(model, [PASS])
    assert initializer(out, "d").tolist() == 4
    assert "Gather" in op_types(out)  # the batch size stays a computed value
    assert report.rules[PASS].rewrites == 1
    rng = np.random.default_rng(0)
    for b, s in ((1, 1), (2, 3)):
        feeds = {"a": rng.standard_normal((b, s, 8)).astype(np.float32),
                 "w": rng.standard_normal((8, 8)).astype(np.float32)}
        assert_same_outputs(model, out, feeds, atol=0, rtol=0)


# -- the paths the fixtures above never take ---------------------------------------------------
def test_shape_size_and_gather_of_an_unknown_shape_stay_without_a_rollback():
    """Nothing is known of x: every candidate declines (a guard that let one through would
    raise, and the rolled-back pass would hide it)."""
    model = model_from_text("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2,3] x_in, int64[K] target, float[2,N] y)
            => (int64[1] a, int64 b, int64 c, int64 d) {
          x = Reshape(x_in, target)
          shape = Shape(x)
          zero = Constant <value = int64[1] {0}> ()
          first = Gather(shape, zero)
          a = Identity(first)
          size = Size(x)
          b = Identity(size)
          ysize = Size(y)
          c = Identity(ysize)
          yshape = Shape(y)
          one = Constant <value = int64 {1}> ()
          n = Gather(yshape, one)
          d = Identity(n)
        }""")
    assert_no_change(model, [PASS])


def test_a_gather_of_something_else_than_a_shape_stays():
    model = model_from_text("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (int64[3] v, float[2,3,5] x) => (int64 y) {
          s = Shape(x)
          w = Add(v, s)
          zero = Constant <value = int64 {0}> ()
          picked = Gather(w, zero)
          y = Identity(picked)
        }""")
    out, report = graphopt.optimize(model, [PASS])
    assert sorted(op_types(out)) == ["Add", "Constant", "Gather", "Identity"]   # the Shape folds
    assert report.rules[PASS].rewrites == 1 and report.rules[PASS].rollbacks == 0


def test_size_of_exactly_int64_max_elements_folds():
    # 2**63 - 1 = 7 * 7 * 73 * 127 * 337 * 92737 * 649657
    model = model_from_text("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[7,7,73,127,337,92737,649657] x) => (int64 n) {
          size = Size(x)
          n = Identity(size)
        }""")
    out, _ = graphopt.optimize(model, [PASS])
    assert initializer(out, "size").tolist() == (1 << 63) - 1


def test_a_slice_with_an_empty_optional_input_and_steps_folds():
    model = model_from_text("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N,3,5,7] x) => (int64[2] y) {
          shape = Shape(x)
          st = Constant <value = int64[1] {1}> ()
          en = Constant <value = int64[1] {4}> ()
          step = Constant <value = int64[1] {2}> ()
          picked = Slice(shape, st, en, , step)
          y = Identity(picked)
        }""")
    out, _ = graphopt.optimize(model, [PASS])
    assert initializer(out, "picked").tolist() == [3, 7]


def test_a_slice_of_opset_9_reads_its_bounds_from_attributes():
    model = model_from_text("""
        <ir_version: 4, opset_import: ["" : 9]>
        g (float[N,3,5,7] x) => (int64[2] y) {
          shape = Shape(x)
          picked = Slice <starts = [1], ends = [3], axes = [0]> (shape)
          y = Identity(picked)
        }""")
    out, _ = graphopt.optimize(model, [PASS])
    assert initializer(out, "picked").tolist() == [3, 5]


def test_an_index_constant_of_more_than_64_values_is_not_read():
    indices = ", ".join(["1"] * 65)
    model = model_from_text(f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[N,3] x) => (int64[65] y, int64[64] z) {{
          shape = Shape(x)
          many = Constant <value = int64[65] {{{indices}}}> ()
          wide = Gather(shape, many)
          y = Identity(wide)
          sixty_four = Constant <value = int64[64] {{{", ".join(["1"] * 64)}}}> ()
          fits = Gather(shape, sixty_four)
          z = Identity(fits)
        }}""")
    out, _ = graphopt.optimize(model, [PASS])
    assert op_types(out).count("Gather") == 1 and initializer(out, "fits").tolist() == [3] * 64


def test_a_shape_that_is_a_graph_output_stays_and_the_next_one_still_folds():
    model = model_from_text("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2,3] x) => (int64[2] s, int64[2] t) {
          s = Shape(x)
          other = Shape(x)
          t = Identity(other)
        }""")
    out, _ = graphopt.optimize(model, [PASS])
    assert op_types(out) == ["Shape", "Identity"] and initializer(out, "other").tolist() == [2, 3]


def _tensor_type(elem_type, dims):
    return onnx.helper.make_tensor_type_proto(elem_type, dims)


@pytest.mark.parametrize("old,new,gains", [
    ((1, ["N", 3]), (1, [2, 3]), True),          # a symbolic dim becomes known
    ((1, None), (1, [2, 3]), True),              # the rank becomes known
    ((1, [2, 3]), (1, [2, 3]), False),           # nothing new
    ((1, ["N", 3]), (1, ["M", 3]), False),       # still symbolic
    ((1, [2, 3]), (1, [4, 3]), False),           # a conflicting dim: never taken
    ((1, ["N", 3]), (1, [2, 4]), False),         # one gained, one conflicting
    ((1, ["N", 3]), (1, [2, 3, 1]), False),      # another rank
    ((1, ["N", 3]), (7, [2, 3]), False),         # another element type
    ((1, ["N", 3]), (1, None), False),           # the new type knows less
])
def test_a_refined_type_is_taken_only_when_it_knows_more_and_contradicts_nothing(old, new,
                                                                                 gains):
    from graphopt.rules.fold_shapes import _more_static
    assert _more_static(_tensor_type(*old), _tensor_type(*new)) is gains


RELU_NEG = """
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[2,3] x) => (float[2,3] y) {
      r = Relu(x)
      y = Neg(r)
    }"""


def test_refined_types_reach_the_main_graph_only_where_inference_knows_more():
    from graphopt.rules.fold_shapes import refine_types
    model = Model(model_from_text(RELU_NEG))
    graph = model.graph
    graph.set_type("r", _tensor_type(1, ["N", 3]))           # told less than inference knows
    refine_types(graph)
    assert type_dims(graph.type_of("r")) == [2, 3]
    graph.set_type("r", _tensor_type(1, [4, 3]))             # told something conflicting
    refine_types(graph)
    assert type_dims(graph.type_of("r")) == [4, 3]           # kept: refining never contradicts


def test_a_tensor_without_a_declared_type_gets_the_inferred_one():
    from graphopt.rules.fold_shapes import refine_types
    model = Model(model_from_text(RELU_NEG))
    assert model.graph.type_of("r") is None
    refine_types(model.graph)
    assert type_dims(model.graph.type_of("r")) == [2, 3]


def test_a_gather_of_a_graph_input_stays():
    model = model_from_text("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (int64[3] v) => (int64 y) {
          one = Constant <value = int64 {1}> ()
          y = Gather(v, one)
        }""")
    assert_no_change(model, [PASS])

"""shape_of_transpose: Shape(Transpose(x, perm)) -> Gather(Shape(x), perm)."""
from __future__ import annotations

from support.models import (
    assert_declined,
    assert_same_outputs,
    assert_second_run_changes_nothing,
    model_from_text,
    op_types,
)

import graphopt

RULE = "shape_of_transpose"


def test_transpose_read_only_by_shape_goes():
    model = model_from_text("""
        <ir_version: 9, opset_import: ["" : 18]>
        g (float[B,S,4,8] x) => (int64[4] s, int64[2] p) {
          t = Transpose <perm = [0, 2, 1, 3]> (x)
          s = Shape(t)
          t2 = Transpose <perm = [3, 0, 2, 1]> (x)
          p = Shape <start = 1, end = -1> (t2)
        }""")
    out, report = graphopt.optimize(model, [RULE])
    assert op_types(out) == ["Shape", "Gather", "Shape", "Gather"]
    assert report.rules[RULE].rewrites == 2
    assert_same_outputs(model, out, atol=0, rtol=0)
    assert_second_run_changes_nothing(out, [RULE])


def test_static_dims_then_fold_at_level_1():
    model = model_from_text("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[B,S,4,8] x) => (float[B,S,4,8] y) {
          t = Transpose <perm = [0, 2, 1, 3]> (x)
          s = Shape(t)
          i = Constant <value = int64 {-1}> ()
          d = Gather(s, i)
          f = Cast <to = 1> (d)
          y = Mul(x, f)
        }""")
    out, _ = graphopt.optimize(model, level=1)
    assert op_types(out) == ["Mul"]
    assert_same_outputs(model, out, atol=0, rtol=0)


def test_transpose_with_other_readers_stays():
    model = model_from_text("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2,3] x) => (int64[2] s, float[3,2] t) {
          t = Transpose <perm = [1, 0]> (x)
          s = Shape(t)
        }""")
    assert_declined(model, RULE, "other readers")


def test_a_transpose_without_perm_is_declined_and_said_why():
    model = model_from_text("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2,3,5] x) => (int64[3] s) {
          t = Transpose(x)
          s = Shape(t)
        }""")
    assert_declined(model, RULE, "the Transpose has no perm (its rank is unknown here)")

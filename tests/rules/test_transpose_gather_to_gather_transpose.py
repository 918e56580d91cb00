"""transpose_gather_to_gather_transpose: Gather(Transpose(x, perm), idx[k], axis) ->
Transpose(Gather(x, idx, axis=perm[axis]), perm)."""
from __future__ import annotations

import onnx
import pytest
from onnx import helper
from support.models import (
    assert_declined,
    assert_no_change,
    assert_same_outputs,
    assert_second_run_changes_nothing,
    model_from_text,
    op_types,
)

import graphopt

RULE = "transpose_gather_to_gather_transpose"


def run(model, **kw):
    return graphopt.optimize(model, [RULE], **kw)


def ops(model):
    return [t for t in op_types(model) if t != "Constant"]


def attrs(node):
    return {a.name: helper.get_attribute_value(a) for a in node.attribute}


def build(gather_axis, index, out_shape, extra="", outputs=""):
    return model_from_text(f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2,8,6,16] x) => (float{out_shape} y{outputs}) {{
          t = Transpose <perm = [2, 0, 1, 3]> (x)
          i = Constant <value = {index}> ()
          y = Gather <axis = {gather_axis}> (t, i)
          {extra}
        }}""")


@pytest.mark.parametrize("axis,index,out_shape,source_axis", [
    (0, "int64[1] {-2}", "[1,2,8,16]", 2),       # dynamo's fused_qkv path
    (-4, "int64[1] {4}", "[1,2,8,16]", 2),
    (1, "int64[2] {1, 0}", "[6,2,8,16]", 0),
    (3, "int32[1] {5}", "[6,2,8,1]", 3),
])
def test_gather_moves_before_the_transpose(axis, index, out_shape, source_axis):
    before = build(axis, index, out_shape)
    out, report = run(before)
    assert ops(out) == ["Gather", "Transpose"]
    gather, transpose = [n for n in out.graph.node if n.op_type != "Constant"]
    assert gather.input[0] == "x" and attrs(gather) == {"axis": source_axis}
    assert attrs(transpose) == {"perm": [2, 0, 1, 3]}
    assert list(transpose.input) == [gather.output[0]] and list(transpose.output) == ["y"]
    assert report.rules[RULE].rewrites == 1
    onnx.checker.check_model(out, full_check=True)
    assert_same_outputs(before, out, atol=0, rtol=0)
    assert_second_run_changes_nothing(out, [RULE])


def test_transpose_with_another_consumer_stays_for_it():
    before = build(0, "int64[1] {0}", "[1,2,8,16]", extra="r = Relu(t)",
                   outputs=", float[6,2,8,16] r")
    out, _ = run(before)
    assert sorted(ops(out)) == ["Gather", "Relu", "Transpose", "Transpose"]
    (relu,) = [n for n in out.graph.node if n.op_type == "Relu"]
    assert list(relu.input) == ["t"]
    assert_same_outputs(before, out, atol=0, rtol=0)


def test_scalar_index_is_not_moved():
    """A scalar index drops the axis, so the same perm would no longer fit."""
    assert_declined(build(0, "int64 {1}", "[2,8,16]"), RULE, "indices are not a constant vector")


def test_runtime_index_is_not_moved():
    before = model_from_text("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2,6] x, int64[1] i) => (float[1,2] y) {
          t = Transpose <perm = [1, 0]> (x)
          y = Gather <axis = 0> (t, i)
        }""")
    assert_declined(before, RULE, "is not a constant")


def test_gather_not_reading_a_transpose_is_not_a_match():
    before = model_from_text("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2,6] x) => (float[1,6] y) {
          i = Constant <value = int64[1] {0}> ()
          y = Gather <axis = 0> (x, i)
        }""")
    report = assert_no_change(before, [RULE])
    assert report.rules[RULE].rewrites == 0

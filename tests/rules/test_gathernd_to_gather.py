"""gathernd_to_gather: GatherND with one-coordinate constant indices -> Gather(axis=0)."""
from __future__ import annotations

import onnx
import pytest
from onnx import numpy_helper
from support.models import (
    assert_declined,
    assert_no_change,
    assert_same_outputs,
    model_from_text,
    op_types,
)

import graphopt

RULE = "gathernd_to_gather"


def run(model, **kw):
    return graphopt.optimize(model, [RULE], **kw)


def model(indices: str, out_shape: str, batch_dims: int | None = None, data="float[6,2,8,16]"):
    attrs = "" if batch_dims is None else f"<batch_dims = {batch_dims}>"
    return model_from_text(f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g ({data} x) => (float{out_shape} y) {{
          i = Constant <value = {indices}> ()
          y = GatherND {attrs} (x, i)
        }}""")


def constant_of(model, name):
    for t in model.graph.initializer:
        if t.name == name:
            return numpy_helper.to_array(t)
    raise KeyError(name)


@pytest.mark.parametrize("indices,out_shape,expected", [
    ("int64[1,1] {-2}", "[1,2,8,16]", [-2]),          # dynamo's fused_qkv[..., [-2], :]
    ("int64[2,1] {0, 5}", "[2,2,8,16]", [0, 5]),
    ("int64[1] {3}", "[2,8,16]", 3),                   # indices of rank 1: a scalar index
    ("int64[2,2,1] {0, 1, 2, 3}", "[2,2,2,8,16]", [[0, 1], [2, 3]]),
])
@pytest.mark.parametrize("batch_dims", [None, 0])
def test_becomes_gather_on_axis_0(indices, out_shape, expected, batch_dims):
    before = model(indices, out_shape, batch_dims)
    out, report = run(before)
    assert op_types(out) == ["Gather"]
    (gather,) = out.graph.node
    assert gather.input[0] == "x" and gather.output[0] == "y"
    assert [(a.name, a.i) for a in gather.attribute] == [("axis", 0)]
    value = constant_of(out, gather.input[1])
    assert value.tolist() == expected and value.dtype.name == "int64"
    assert report.rules[RULE].rewrites == 1
    onnx.checker.check_model(out, full_check=True)
    assert_same_outputs(before, out, atol=0, rtol=0)
    report = assert_no_change(out, [RULE])
    assert report.rules[RULE].candidates == 0


def test_two_coordinates_are_not_converted():
    assert_declined(model("int64[1,2] {1, 0}", "[1,8,16]"),
                    RULE, "indices are not constant ints with last dimension 1")


def test_batch_dims_1_is_not_converted():
    assert_declined(model("int64[6,1] {0, 1, 0, 1, 0, 1}", "[6,8,16]", batch_dims=1),
                    RULE, "batch_dims=1 rejected")


def test_runtime_indices_are_not_converted():
    before = model_from_text("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[6,2] x, int64[1,1] i) => (float[1,2] y) {
          y = GatherND(x, i)
        }""")
    assert_declined(before, RULE, "is not a constant")

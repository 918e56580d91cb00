"""Small graphs that show bugs found by the property tests, shared by the regression tests
and by the property test (which must not fail on a bug that already has its own xfail test,
and must become strict again, by itself, once the bug is fixed)."""
from __future__ import annotations

import functools

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import graphopt

MS = "com.microsoft"


def stale_marks_model() -> onnx.ModelProto:
    """x / 2 is a graph output and feeds the MatMul that feeds YieldOp. The level-2 scale
    fusion turns MatMul(x / 2, W) into FusedMatMul(x, W, alpha=0.5), after which the Div is
    no longer an ancestor of YieldOp, but mark_backward_pass (level 1) does not run again."""
    n = helper.make_node
    graph = helper.make_graph(
        [n("Div", ["x", "two"], ["xs"], name="scale"),
         n("MatMul", ["xs", "W"], ["y"], name="mm"),
         n("YieldOp", ["y"], ["gy"], name="yield", domain=MS, full_shape_outputs=[0]),
         n("Mul", ["gy", "gy"], ["g"], name="bw_mul")],
        "stale_marks",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("xs", TensorProto.FLOAT, [2, 3]),
         helper.make_tensor_value_info("g", TensorProto.FLOAT, [2, 4])],
        initializer=[numpy_helper.from_array(np.array(2.0, np.float32), "two"),
                     numpy_helper.from_array(
                         np.arange(12, dtype=np.float32).reshape(3, 4), "W")],
        value_info=[helper.make_tensor_value_info("gy", TensorProto.FLOAT, [2, 4])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                   helper.make_opsetid(MS, 1)])


@functools.cache
def stale_marks_after_level2() -> bool:
    """True while optimize() is not a fixpoint on ``stale_marks_model`` (the bug is open)."""
    once, _ = graphopt.optimize(stale_marks_model())
    twice, _ = graphopt.optimize(once)
    return once.SerializeToString() != twice.SerializeToString()


def without_marks(model: onnx.ModelProto) -> bytes:
    copy = onnx.ModelProto()
    copy.CopyFrom(model)
    for node in copy.graph.node:
        kept = [a for a in node.attribute if a.name != "__backwardpass"]
        del node.attribute[:]
        node.attribute.extend(kept)
    return copy.SerializeToString()


def fan_out_model() -> onnx.ModelProto:
    """t = Transpose(x) read by Slice t[1:], Slice t[0:1] and Gather(t, [0]) (see
    test_regressions.fan_out_freed_by_another_rewrite_model)."""
    n = helper.make_node
    i64 = lambda name, v: numpy_helper.from_array(np.array(v, np.int64), name)  # noqa: E731
    graph = helper.make_graph(
        [n("Transpose", ["x"], ["t"], perm=[1, 0]),
         n("Slice", ["t", "one", "big", "zero"], ["tail"], name="tail"),
         n("Slice", ["t", "zero", "one", "zero"], ["head"], name="head"),
         n("Gather", ["t", "idx"], ["g"], name="gather", axis=0)],
        "fan_out", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 2])],
        [helper.make_tensor_value_info(name, TensorProto.FLOAT, [1, 3])
         for name in ("tail", "head", "g")],
        initializer=[i64("one", [1]), i64("big", [9]), i64("zero", [0]), i64("idx", [0])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


@functools.cache
def fan_out_not_retried() -> bool:
    """True while the Split fusion is missed on ``fan_out_model`` (the bug is open)."""
    _, report = graphopt.optimize(fan_out_model())
    return "gather_slice_to_split" not in report.fired

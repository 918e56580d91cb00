"""Kernels that read an earlier result of the same run (KernelSpec.reads_also): GeluGrad and
BiasGeluGrad_dX take the forward's GeLU output instead of computing the erf again.
The plan chooses it, keeps it alive until the gradient has run, and the gradient agrees with
the one computed from x alone."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from graphopt.executor import Session
from graphopt.executor.kernels._util import gelu_exact, gelu_exact_grad, gelu_exact_grad_from_output
from graphopt.executor.plan import PlannedNode, _reads_also
from graphopt.executor.registry import KernelSpec

from .helpers import FLOAT, MS

SHAPE = [6, 40]


def _model(forward: helper.NodeProto, grad: helper.NodeProto, inputs: list[str],
           outputs: list[str], opset: int = 17, extra_nodes=()):
    graph = helper.make_graph(
        [forward, *extra_nodes, grad], "g",
        [helper.make_tensor_value_info(n, FLOAT, SHAPE if n != "b" else SHAPE[-1:])
         for n in inputs],
        [helper.make_tensor_value_info(n, FLOAT, None) for n in outputs])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset),
                                                   helper.make_opsetid(MS, 1)], ir_version=10)


def _feeds(*names):
    rng = np.random.default_rng(3)
    return {n: (rng.standard_normal(SHAPE if n != "b" else SHAPE[-1:]) * 3).astype(np.float32)
            for n in names}


def _grad_step(session, fetches):
    plan = session.plan(fetches)
    (step,) = [s for s in plan.steps if s.node.op_type.startswith(("GeluGrad", "BiasGeluGrad"))]
    return plan, step


@pytest.mark.parametrize("forward", [
    helper.make_node("Gelu", ["x"], ["y"], domain=MS, name="fwd"),
    helper.make_node("Gelu", ["x"], ["y"], name="fwd"),  # ONNX Gelu, approximate 'none'
])
def test_gelu_grad_reads_the_forward_gelu_and_keeps_it_alive_until_then(forward):
    opset = 20 if forward.domain == "" else 17
    # y is read by the Mul first; the gradient comes after it
    model = _model(forward, helper.make_node("GeluGrad", ["dy", "x"], ["dx"], domain=MS),
                   ["x", "dy", "w"], ["z", "dx"], opset,
                   extra_nodes=[helper.make_node("Mul", ["y", "w"], ["z"])])
    session = Session(model, device="cpu")
    plan, step = _grad_step(session, ("z", "dx"))
    y_slot = plan.slot_of["y"]
    assert step.also == (("gelu_x", y_slot),)
    mul = next(s for s in plan.steps if s.node.op_type == "Mul")
    assert y_slot not in mul.release and y_slot in step.release
    feeds = _feeds("x", "dy", "w")
    dx = session.run(feeds, ["z", "dx"])["dx"]
    x, dy = feeds["x"], feeds["dy"]
    np.testing.assert_array_equal(dx, gelu_exact_grad_from_output(dy, x, gelu_exact(np, x)))
    np.testing.assert_allclose(dx, dy * gelu_exact_grad(np, x), rtol=0,
                               atol=2.0 ** -23 * np.abs(dy).max())


@pytest.mark.parametrize("forward, opset", [
    (helper.make_node("Gelu", ["x"], ["y"], approximate="tanh"), 20),  # another function
    (helper.make_node("FastGelu", ["x"], ["y"], domain=MS), 17),
    (helper.make_node("Gelu", ["dy"], ["y"], domain=MS), 17),  # GeLU of another tensor
])
def test_gelu_grad_reads_no_other_forward(forward, opset):
    model = _model(forward, helper.make_node("GeluGrad", ["dy", "x"], ["dx"], domain=MS),
                   ["x", "dy"], ["y", "dx"], opset)
    session = Session(model, device="cpu")
    _, step = _grad_step(session, ("y", "dx"))
    assert step.also == ()
    feeds = _feeds("x", "dy")
    np.testing.assert_array_equal(session.run(feeds)["dx"],
                                  feeds["dy"] * gelu_exact_grad(np, feeds["x"]))


def test_gelu_grad_without_the_forward_in_the_plan_computes_the_erf():
    model = _model(helper.make_node("Gelu", ["x"], ["y"], domain=MS),
                   helper.make_node("GeluGrad", ["dy", "x"], ["dx"], domain=MS),
                   ["x", "dy"], ["y", "dx"])
    session = Session(model, device="cpu")
    plan, step = _grad_step(session, ("dx",))
    assert [s.node.op_type for s in plan.steps] == ["GeluGrad"] and step.also == ()
    feeds = _feeds("x", "dy")
    np.testing.assert_array_equal(session.run(feeds, ["dx"])["dx"],
                                  feeds["dy"] * gelu_exact_grad(np, feeds["x"]))


def test_half_precision_gelu_grad_keeps_the_general_path():
    model = _model(helper.make_node("Gelu", ["x"], ["y"], domain=MS),
                   helper.make_node("GeluGrad", ["dy", "x"], ["dx"], domain=MS),
                   ["x", "dy"], ["y", "dx"])
    for value_info in model.graph.input:
        value_info.type.tensor_type.elem_type = helper.np_dtype_to_tensor_dtype(
            np.dtype(np.float16))
    session = Session(model, device="cpu")
    feeds = {k: v.astype(np.float16) for k, v in _feeds("x", "dy").items()}
    x32, dy32 = (feeds[k].astype(np.float32) for k in ("x", "dy"))
    np.testing.assert_array_equal(session.run(feeds)["dx"],
                                  (dy32 * gelu_exact_grad(np, x32)).astype(np.float16))


def test_bias_gelu_grad_reads_the_forward_bias_gelu():
    model = _model(helper.make_node("BiasGelu", ["x", "b"], ["y"], domain=MS),
                   helper.make_node("BiasGeluGrad_dX", ["dy", "x", "b"], ["dx"], domain=MS),
                   ["x", "b", "dy"], ["y", "dx"])
    session = Session(model, device="cpu")
    plan, step = _grad_step(session, ("y", "dx"))
    assert step.also == (("gelu_x", plan.slot_of["y"]),)
    feeds = _feeds("x", "b", "dy")
    v = feeds["x"] + feeds["b"]
    dx = session.run(feeds)["dx"]
    np.testing.assert_array_equal(dx, gelu_exact_grad_from_output(feeds["dy"], v,
                                                                   gelu_exact(np, v)))
    np.testing.assert_allclose(dx, feeds["dy"] * gelu_exact_grad(np, v), rtol=0,
                               atol=2.0 ** -23 * np.abs(feeds["dy"]).max())


def test_a_chooser_naming_a_tensor_no_earlier_node_makes_is_refused():
    def node(index, op_type, inputs, outputs, reads_also=None):
        spec = KernelSpec("", op_type, 1, 1, lambda *a, **k: None, False,
                          reads_also=reads_also)
        return PlannedNode(index, f"n{index}", op_type, "", 17, inputs, outputs, {}, spec)

    first = node(0, "Relu", ("x",), ("a",))
    later = node(2, "Neg", ("a",), ("c",))
    asks_later = node(1, "Abs", ("a",), ("b",), reads_also=lambda n, readers: {"k": "c"})
    with pytest.raises(ValueError, match="no earlier node makes"):
        _reads_also(1, asks_later, [first, asks_later, later])
    asks_earlier = node(1, "Abs", ("a",), ("b",),
                        reads_also=lambda n, readers: {"k": readers("x")[0].outputs[0]})
    assert _reads_also(1, asks_earlier, [first, asks_earlier, later]) == {"k": "a"}

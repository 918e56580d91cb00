"""A hand-built ORTModule-style training graph: forward, YieldOp, backward -> weight grads."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from graphopt.executor import FeedError, Session

from .helpers import MS

N, D, H, OUT = 4, 3, 5, 2


def _training_model():
    bw = {"__backwardpass": 1}
    forward = [
        helper.make_node("MatMul", ["x", "w1"], ["z"], name="fc1"),
        helper.make_node("Relu", ["z"], ["h"], name="relu"),
        helper.make_node("MatMul", ["h", "w2"], ["y"], name="fc2"),
        helper.make_node("ReduceSum", ["y"], ["loss"], name="loss", keepdims=0),
    ]
    yield_node = helper.make_node("YieldOp", ["loss"], ["loss_grad"], name="yield", domain=MS,
                                  full_shape_outputs=[0], **bw)
    backward = [
        helper.make_node("Shape", ["y"], ["y_shape"], name="shape_y", **bw),
        helper.make_node("Expand", ["loss_grad", "y_shape"], ["dy"], name="expand", **bw),
        helper.make_node("FusedMatMul", ["h", "dy"], ["w2_grad"], name="dw2", domain=MS, transA=1,
                         **bw),
        helper.make_node("FusedMatMul", ["dy", "w2"], ["dh"], name="dh", domain=MS, transB=1, **bw),
        helper.make_node("ReluGrad", ["dh", "z"], ["dz"], name="drelu", domain=MS, **bw),
        helper.make_node("FusedMatMul", ["x", "dz"], ["w1_grad"], name="dw1", domain=MS, transA=1,
                         **bw),
    ]
    graph = helper.make_graph(
        forward + [yield_node] + backward, "train",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [N, D]),
         helper.make_tensor_value_info("w1", TensorProto.FLOAT, [D, H]),
         helper.make_tensor_value_info("w2", TensorProto.FLOAT, [H, OUT])],
        [helper.make_tensor_value_info("w1_grad", TensorProto.FLOAT, [D, H]),
         helper.make_tensor_value_info("w2_grad", TensorProto.FLOAT, [H, OUT])],
        value_info=[helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                   helper.make_opsetid(MS, 1)])


def _analytic(x, w1, w2, dloss):
    z = x @ w1
    h = np.maximum(z, 0)
    dy = np.full((N, OUT), dloss, np.float32)
    dw2 = h.T @ dy
    dz = (dy @ w2.T) * (z > 0)
    return x.T @ dz, dw2


@pytest.fixture
def feeds():
    rng = np.random.default_rng(5)
    return {"x": rng.standard_normal((N, D)).astype(np.float32),
            "w1": rng.standard_normal((D, H)).astype(np.float32),
            "w2": rng.standard_normal((H, OUT)).astype(np.float32)}


def test_model_is_valid_onnx():
    onnx.checker.check_model(_training_model())


def test_training_step_default_loss_gradient_is_one(feeds):
    out = Session(_training_model(), device="cpu").run(feeds)
    dw1, dw2 = _analytic(feeds["x"], feeds["w1"], feeds["w2"], 1.0)
    np.testing.assert_allclose(out["w1_grad"], dw1, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out["w2_grad"], dw2, rtol=1e-5, atol=1e-6)


def test_caller_feeds_the_yield_output_gradient(feeds):
    session = Session(_training_model(), device="cpu")
    out = session.run({**feeds, "loss_grad": np.array(2.5, np.float32)},
                      ["w1_grad", "w2_grad", "loss"])
    dw1, dw2 = _analytic(feeds["x"], feeds["w1"], feeds["w2"], 2.5)
    np.testing.assert_allclose(out["w1_grad"], dw1, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out["w2_grad"], dw2, rtol=1e-5, atol=1e-6)
    z = feeds["x"] @ feeds["w1"]
    np.testing.assert_allclose(out["loss"], (np.maximum(z, 0) @ feeds["w2"]).sum(), rtol=1e-5)


def test_yield_gradient_feed_is_checked(feeds):
    session = Session(_training_model(), device="cpu")
    with pytest.raises(FeedError, match="loss_grad.*float64"):
        session.run({**feeds, "loss_grad": np.array(1.0)})
    with pytest.raises(FeedError, match="loss_grad"):
        session.run({**feeds, "loss_grad": np.ones((2,), np.float32)})


def test_backward_nodes_run_under_the_numerics_guard(feeds):
    from .test_session import _RecordingNumerics

    numerics = _RecordingNumerics()
    Session(_training_model(), device="cpu", numerics=numerics).run(feeds)
    by_node = {node: backward for node, _, backward in numerics.calls}
    assert by_node == {"fc1": False, "fc2": False, "dw2": True, "dh": True, "dw1": True}

"""Named losses (cross-entropy, MSE), a loss already in the model, kept outputs."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper, numpy_helper

from graphopt.errors import GraphoptError
from graphopt.training import build_training_graph

from .helpers import (
    DOUBLE,
    ForwardRunner,
    central_differences,
    fixture,
    model,
    run_training,
    to_float64,
)

PARAMS = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]


def cross_entropy(logits, labels):
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_prob = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    return -log_prob[np.arange(len(labels)), labels].mean()


def mean_squared_error(prediction, target):
    return ((prediction - target) ** 2).mean()


def mlp_float64():
    path, data, _ = fixture("mlp")
    forward = to_float64(onnx.load(path))
    weights = {t.name: numpy_helper.to_array(t) for t in forward.graph.initializer}
    return forward, data["x"].astype(np.float64), weights


@pytest.mark.parametrize("loss", ["cross_entropy", "mse"])
def test_named_loss_matches_finite_differences(loss):
    forward, x, weights = mlp_float64()
    rng = np.random.default_rng(1)
    if loss == "cross_entropy":
        label_name, labels = "labels", rng.integers(0, 10, size=4)
        loss_fn = cross_entropy
    else:
        label_name, labels = "target", rng.standard_normal((4, 10))
        loss_fn = mean_squared_error
    training = build_training_graph(forward, loss=loss)
    assert [o.name for o in training.proto.graph.output] == ["loss"] + [f"{p}_grad" for p in PARAMS]
    assert training.losses == ["loss"] and training.params == PARAMS
    assert label_name in {i.name for i in training.proto.graph.input}
    result = run_training(training, {"x": x, label_name: labels})

    runner = ForwardRunner(forward, fed_initializers=PARAMS)
    values = {"x": x, **weights}
    assert result["loss"] == pytest.approx(loss_fn(runner(values)["output"], labels), rel=1e-10)
    for param in PARAMS:
        expected = central_differences(lambda v: loss_fn(runner(v)["output"], labels), values,
                                       param)
        np.testing.assert_allclose(result[f"{param}_grad"], expected, rtol=1e-5, atol=1e-8,
                                   err_msg=param)


@pytest.mark.parametrize("loss", ["cross_entropy", "mse"])
def test_named_loss_matches_torch_autograd(loss):
    torch = pytest.importorskip("torch")
    path, data, _ = fixture("mlp")
    forward = onnx.load(path)
    weights = {t.name: numpy_helper.to_array(t) for t in forward.graph.initializer}
    rng = np.random.default_rng(2)
    if loss == "cross_entropy":
        labels = rng.integers(0, 10, size=4)
        feeds = {"x": data["x"], "labels": labels}
    else:
        labels = rng.standard_normal((4, 10)).astype(np.float32)
        feeds = {"x": data["x"], "target": labels}
    result = run_training(build_training_graph(forward, loss=loss), feeds)

    params = {k: torch.tensor(v, requires_grad=True) for k, v in weights.items()}
    hidden = torch.relu(torch.tensor(data["x"]) @ params["fc1.weight"].T + params["fc1.bias"])
    logits = hidden @ params["fc2.weight"].T + params["fc2.bias"]
    if loss == "cross_entropy":
        value = torch.nn.functional.cross_entropy(logits, torch.tensor(labels))
    else:
        value = torch.nn.functional.mse_loss(logits, torch.tensor(labels))
    value.backward()
    np.testing.assert_allclose(result["loss"], value.item(), rtol=1e-5)
    for name, tensor in params.items():
        np.testing.assert_allclose(result[f"{name}_grad"], tensor.grad.numpy(), rtol=1e-4,
                                   atol=1e-6, err_msg=name)


def _model_with_its_own_loss():
    """y = tanh(x @ w); loss = mean(y * y); outputs: loss and y."""
    rng = np.random.default_rng(3)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["xw"], name="mm"),
             helper.make_node("Tanh", ["xw"], ["y"], name="tanh"),
             helper.make_node("Mul", ["y", "y"], ["sq"], name="sq"),
             helper.make_node("ReduceMean", ["sq"], ["loss"], name="mean", keepdims=0)]
    forward = model(nodes, [helper.make_tensor_value_info("x", DOUBLE, [3, 4])],
                    [helper.make_tensor_value_info("loss", DOUBLE, []),
                     helper.make_tensor_value_info("y", DOUBLE, [3, 2])],
                    {"w": rng.standard_normal((4, 2))})
    return forward, rng.standard_normal((3, 4))


def test_loss_already_in_the_model():
    forward, x = _model_with_its_own_loss()
    training = build_training_graph(forward, outputs="loss")
    assert [o.name for o in training.proto.graph.output] == ["loss", "w_grad"]
    result = run_training(training, {"x": x})  # YieldOp's loss gradient defaults to one
    runner = ForwardRunner(forward, fed_initializers=["w"])
    w = numpy_helper.to_array(forward.graph.initializer[0])
    expected = central_differences(lambda v: float(runner(v)["loss"]), {"x": x, "w": w}, "w")
    np.testing.assert_allclose(result["w_grad"], expected, rtol=1e-6, atol=1e-9)


def test_kept_output_passes_the_yield_op_without_a_gradient():
    forward, x = _model_with_its_own_loss()
    training = build_training_graph(forward, outputs="loss", keep_outputs=["y"])
    yield_node = next(n for n in training.proto.graph.node if n.op_type == "YieldOp")
    attrs = {a.name: helper.get_attribute_value(a) for a in yield_node.attribute}
    assert list(yield_node.input) == ["loss", "y"] and len(yield_node.output) == 1
    assert attrs == {"full_shape_outputs": [0], "non_differentiable_outputs": [1]}
    assert [o.name for o in training.proto.graph.output] == ["loss", "y", "w_grad"]
    reference = run_training(build_training_graph(forward, outputs="loss"), {"x": x})
    result = run_training(training, {"x": x})
    np.testing.assert_allclose(result["w_grad"], reference["w_grad"])
    np.testing.assert_allclose(result["y"], np.tanh(x @ numpy_helper.to_array(
        forward.graph.initializer[0])))


def test_output_mode_takes_every_module_output():
    forward, x = _model_with_its_own_loss()
    training = build_training_graph(forward, loss="output")
    yield_node = next(n for n in training.proto.graph.node if n.op_type == "YieldOp")
    assert list(yield_node.output) == ["loss_grad", "y_grad"] == training.loss_grads
    g = np.random.default_rng(4).standard_normal((3, 2))
    both = run_training(training, {"x": x, "loss_grad": np.array(2.0), "y_grad": g})
    loss_only = run_training(build_training_graph(forward, outputs="loss"), {"x": x})
    y_only = run_training(build_training_graph(forward, loss="output", outputs="y"),
                          {"x": x, "y_grad": g})
    np.testing.assert_allclose(both["w_grad"], 2 * loss_only["w_grad"] + y_only["w_grad"])


@pytest.mark.parametrize("options, message", [
    ({}, "say which graph output is the loss"),
    ({"outputs": "y"}, "not a scalar loss"),
    ({"outputs": "nope"}, "'nope': not a graph output"),
    ({"loss": "hinge"}, "unknown loss 'hinge'"),
    ({"loss": "mse", "outputs": "y", "labels_name": "x"}, "already a name in the model"),
])
def test_loss_option_errors(options, message):
    forward, _ = _model_with_its_own_loss()
    with pytest.raises(GraphoptError, match=message):
        build_training_graph(forward, **options)

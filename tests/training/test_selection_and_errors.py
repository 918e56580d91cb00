"""Which initializers train, what is refused, and graphs that already have a YieldOp."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from graphopt.errors import GraphoptError
from graphopt.training import TrainingGraph, build_training_graph
from graphopt.training.selection import select_trainable

from .helpers import DOUBLE, MS, fixture, model, run_training

FLOAT, INT64 = TensorProto.FLOAT, TensorProto.INT64
MLP_PARAMS = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]


def grad_outputs(training: TrainingGraph) -> list[str]:
    """The tensors that get a gradient, as the graph's outputs say it."""
    grads = {**training.grads, **training.input_grads}
    outputs = [o.name for o in training.proto.graph.output]
    return [tensor for tensor, grad in grads.items() if grad in outputs]


# ---- selection --------------------------------------------------------------------------------
INITIALIZERS = [("enc.w", FLOAT), ("enc.b", FLOAT), ("head.w", FLOAT), ("shape", INT64),
                ("head.idx", INT64)]


@pytest.mark.parametrize("options, expected", [
    ({}, ["enc.w", "enc.b", "head.w"]),
    ({"freeze": ["enc.*"]}, ["head.w"]),
    ({"freeze": "*", "train": ["head.*"]}, ["head.w"]),  # train wins; head.idx is an integer
    ({"trainable": ["enc.w", "head.?"]}, ["enc.w", "head.w"]),
    ({"trainable": "*.w", "train": "enc.b"}, ["enc.w", "enc.b", "head.w"]),
])
def test_trainable_selection(options, expected):
    assert select_trainable(INITIALIZERS, **options) == expected


@pytest.mark.parametrize("options, message", [
    ({"freeze": ["dec.*"]}, "freeze: 'dec.\\*' match\\(es\\) no candidate"),
    ({"train": ["enc.W"]}, "train: 'enc.W'"),
    ({"train": ["shape"]}, "'shape' is not floating-point"),
    ({"trainable": ["head.idx"]}, "integer initializers are never trainable"),
])
def test_selection_errors(options, message):
    with pytest.raises(GraphoptError, match=message):
        select_trainable(INITIALIZERS, **options)


def test_frozen_parameters_get_no_gradient_and_others_are_unchanged():
    path, data, _ = fixture("mlp")
    feeds = {"x": data["x"], "output_grad": data["grad_output"]}
    full = run_training(build_training_graph(path, loss="output"), feeds)
    training = build_training_graph(path, loss="output", freeze=["fc1.*"])
    assert grad_outputs(training) == ["fc2.weight", "fc2.bias"]
    assert training.frozen == ["fc1.weight", "fc1.bias"]
    # fc1 stays a plain initializer: only trained weights are listed as graph inputs
    assert {i.name for i in training.proto.graph.input} == {"x", "fc2.weight", "fc2.bias"}
    # nothing flows into the frozen layer: no ReluGrad, no fc1 Gemm gradients
    assert "ReluGrad" not in {n.op_type for n in training.proto.graph.node}
    result = run_training(training, feeds)
    for param in ["fc2.weight", "fc2.bias"]:
        np.testing.assert_array_equal(result[f"{param}_grad"], full[f"{param}_grad"])


def test_integer_initializers_are_never_trainable():
    path, _, meta = fixture("mqa_dynamo")
    training = build_training_graph(path, loss="output")
    integers = {t.name for t in onnx.load(path).graph.initializer if t.data_type == INT64}
    assert integers and not integers & set(grad_outputs(training))
    assert set(meta["param_map"].values()) <= set(grad_outputs(training))


def test_input_gradients_on_request():
    path, data, _ = fixture("mlp")
    training = build_training_graph(path, loss="output", trainable=[], input_grads=["x"])
    assert grad_outputs(training) == ["x"]
    result = run_training(training, {"x": data["x"], "output_grad": data["grad_output"]})
    assert result["x_grad"].shape == data["x"].shape


def test_unused_parameter_gets_a_zero_gradient():
    nodes = [helper.make_node("Mul", ["x", "w"], ["y"], name="mul")]
    forward = model(nodes, [helper.make_tensor_value_info("x", DOUBLE, [2])],
                    [helper.make_tensor_value_info("y", DOUBLE, [2])],
                    {"w": np.ones(2), "unused": np.ones((3, 2))})
    result = run_training(build_training_graph(forward, loss="output"), {"x": np.ones(2)})
    np.testing.assert_array_equal(result["unused_grad"], np.zeros((3, 2)))


# ---- missing gradient definitions ---------------------------------------------------------------
def _model_through(*op_types):
    """w -> op1 -> op2 -> ... -> Mul(., k) = y, with w and k trainable."""
    nodes, previous = [], "w"
    for i, op_type in enumerate(op_types):
        nodes.append(helper.make_node(op_type, [previous], [f"t{i}"], name=f"{op_type.lower()}{i}"))
        previous = f"t{i}"
    nodes.append(helper.make_node("Mul", [previous, "k"], ["y"], name="scale"))
    return model(nodes, [], [helper.make_tensor_value_info("y", DOUBLE, [2])],
                 {"w": np.ones(2), "k": np.ones(2)})


def test_missing_gradient_definitions_are_listed_all_at_once():
    forward = _model_through("Sin", "Relu", "Cos", "Sin")
    with pytest.raises(GraphoptError) as error:
        build_training_graph(forward, loss="output")
    message = str(error.value)
    assert "2 op type(s)" in message
    assert "Cos (node 'cos2')" in message and "Sin (nodes 'sin0', 'sin3')" in message
    assert "Relu" not in message


def test_frozen_branch_needs_no_gradient_definition():
    forward = _model_through("Sin", "Cos")
    training = build_training_graph(forward, loss="output", freeze=["w"])
    assert grad_outputs(training) == ["k"]


# ---- graphs that already are training graphs --------------------------------------------------
def test_yield_op_graph_is_returned_as_is():
    path, _, _ = fixture("mlp")
    training = build_training_graph(path, loss="output")
    again = build_training_graph(training)
    assert again.proto.SerializeToString() == training.proto.SerializeToString()
    assert again == training
    assert build_training_graph(training.proto) == training


def test_two_yield_ops_are_refused():
    path, _, _ = fixture("mlp")
    training = build_training_graph(path, loss="output")
    extra = helper.make_node("YieldOp", ["output"], ["output_grad_2"], domain=MS, name="second",
                             full_shape_outputs=[0])
    training.proto.graph.node.append(extra)
    with pytest.raises(GraphoptError, match="2 YieldOp nodes .*'second'"):
        build_training_graph(training)


def test_options_on_a_training_graph_are_refused():
    path, _, _ = fixture("mlp")
    training = build_training_graph(path, loss="output")
    with pytest.raises(GraphoptError, match="already a training graph .*freeze do"):
        build_training_graph(training, freeze=["fc1.*"])

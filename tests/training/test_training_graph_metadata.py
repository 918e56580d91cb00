"""The training graph is a data contract: build_training_graph says which output holds which
gradient, records it in the model's metadata, and reads it back checked; graphs without it
(ORTModule's) are read by their output names."""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import graphopt
from graphopt.errors import GraphoptError
from graphopt.training import TrainingGraph, build_training_graph
from graphopt.training.graph import METADATA_KEY

from .helpers import fixture, run_training

FLOAT = TensorProto.FLOAT


def taken_name_model() -> onnx.ModelProto:
    """y = Tanh(x @ W) with the MatMul's output named ``W_grad``, and a frozen scale s."""
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["W_grad"]),
         helper.make_node("Mul", ["W_grad", "s"], ["z"]),
         helper.make_node("Tanh", ["z"], ["y"])],
        "g", [helper.make_tensor_value_info("x", FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", FLOAT, [2, 2])],
        [numpy_helper.from_array(np.arange(6, dtype=np.float32).reshape(3, 2) / 6, "W"),
         numpy_helper.from_array(np.full(2, 0.5, np.float32), "s")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def metadata(proto: onnx.ModelProto) -> dict:
    (entry,) = [p for p in proto.metadata_props if p.key == METADATA_KEY]
    return json.loads(entry.value)


def with_metadata(proto: onnx.ModelProto, value: str) -> onnx.ModelProto:
    copy = onnx.ModelProto()
    copy.CopyFrom(proto)
    (entry,) = [p for p in copy.metadata_props if p.key == METADATA_KEY]
    entry.value = value
    return copy


def test_the_gradient_output_is_stated_not_guessed():
    training = build_training_graph(taken_name_model(), loss="output", freeze=["s"])
    assert training.params == ["W"] and training.grads == {"W": "W_grad_1"}
    assert training.frozen == ["s"]
    assert training.losses == ["y"] and training.loss_grads == ["y_grad"]
    x, g = np.ones((2, 3), np.float32), np.ones((2, 2), np.float32)
    result = run_training(training, {"x": x, "y_grad": g})
    w = numpy_helper.to_array(taken_name_model().graph.initializer[0])
    z = (x @ w) * 0.5
    expected = x.T @ (g * (1 - np.tanh(z) ** 2) * 0.5)
    np.testing.assert_allclose(result[training.grads["W"]], expected, rtol=1e-5)


def test_metadata_round_trips_through_a_file_and_an_optimize(tmp_path):
    training = build_training_graph(taken_name_model(), loss="output")
    assert metadata(training.proto) == {"version": 1, **{
        k: v for k, v in training.metadata().items() if k != "version"}}
    path = tmp_path / "training.onnx"
    onnx.save(training.proto, path)
    graphopt.optimize_file(str(path), str(tmp_path / "optimized.onnx"))
    for saved in (path, tmp_path / "optimized.onnx"):
        again = TrainingGraph.from_model(onnx.load(saved))
        assert (again.params, again.grads, again.losses, again.loss_grads, again.frozen) == (
            training.params, training.grads, training.losses, training.loss_grads,
            training.frozen)


def test_a_graph_without_metadata_is_read_by_its_output_names():
    path, _, meta = fixture("mlp")
    built = build_training_graph(path, loss="output")
    del built.proto.metadata_props[:]
    discovered = TrainingGraph.from_model(built.proto)
    assert discovered.params == list(meta["grads"])
    assert discovered.grads == {p: f"{p}_grad" for p in meta["grads"]}
    assert discovered.losses == ["output"] and discovered.loss_grads == ["output_grad"]
    assert metadata(discovered.proto)["params"] == discovered.params  # described from now on


@pytest.mark.parametrize("change, message", [
    (lambda m: m.update(version=2), "has version 2; this graphopt reads version 1"),
    (lambda m: m.update(params=["W", "nowhere"]), "not one per trained parameter"),
    (lambda m: m["grads"].update(W="y"), "gradient 'y' is a YieldOp input"),
    (lambda m: m["grads"].update(W="missing"), "gradient 'missing' is not a graph output"),
    (lambda m: m["grads"].update(W=m["grads"]["s"]), "share a gradient output"),
    (lambda m: m.update(losses=["W_grad"]), "loss 'W_grad' is not a YieldOp input"),
    (lambda m: m.update(frozen=["W"]), "both trained and frozen"),
    (lambda m: m.update(params="W"), "'params' is missing or not a list"),
    (lambda m: m.pop("loss_grads"), "'loss_grads' is missing"),
    (lambda m: m.update(extra=1), "unknown field"),
])
def test_inconsistent_metadata_is_one_clear_error(change, message):
    training = build_training_graph(taken_name_model(), loss="output")
    data = metadata(training.proto)
    change(data)
    tampered = with_metadata(training.proto, json.dumps(data))
    with pytest.raises(GraphoptError, match=message) as error:
        TrainingGraph.from_model(tampered)
    assert "\n" not in str(error.value) and METADATA_KEY in str(error.value)
    with pytest.raises(GraphoptError, match=message):
        build_training_graph(tampered)


def test_metadata_that_is_not_json_is_refused():
    training = build_training_graph(taken_name_model(), loss="output")
    with pytest.raises(GraphoptError, match="is not JSON"):
        TrainingGraph.from_model(with_metadata(training.proto, "{params: W"))


def test_ortmodules_own_training_graph_is_read_by_its_output_names():
    """ORTModule feeds its weights as graph inputs: they are inputs with a gradient here."""
    path, data, meta = fixture("ortmodule_lm")
    graph = TrainingGraph.from_model(onnx.load(path))
    assert sorted(graph.input_grads.values()) == sorted(meta["grads"])
    assert graph.params == [] and graph.losses == ["output-0"]
    assert graph.loss_grads == ["output-0_grad"]
    assert set(graph.data_inputs) == set(meta["inputs"])

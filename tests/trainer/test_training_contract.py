"""`graphopt run` trains what the training graph says it trains, not what its output names
suggest: a model whose own tensor is called ``W_grad`` gets the gradient output ``W_grad_1``
and is still trained."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper
from support.training_runs import write_npz

from graphopt.cli import main
from graphopt.trainer import RunOptions, run


def taken_grad_name_model(path, bias: bool = True) -> str:
    """y = Relu(x @ W + b) (b optional), with the MatMul's output named ``W_grad`` (any
    exporter may pick that name): the gradient output of W must be named around it."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["W_grad"], name="matmul")]
    weights = [numpy_helper.from_array(rng.standard_normal((3, 2)).astype(np.float32), "W")]
    if bias:
        nodes.append(helper.make_node("Add", ["W_grad", "b"], ["z"], name="add"))
        weights.append(numpy_helper.from_array(np.full(2, 0.5, np.float32), "b"))
    nodes.append(helper.make_node("Relu", ["z" if bias else "W_grad"], ["y"], name="relu"))
    graph = helper.make_graph(
        nodes, "taken_grad_name",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 2])], weights)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save(model, path)
    return str(path)


def data(path) -> str:
    rng = np.random.default_rng(1)
    return write_npz(path, {"x": rng.standard_normal((8, 3)).astype(np.float32),
                            "target": rng.standard_normal((8, 2)).astype(np.float32)})


def weights(path) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in onnx.load(path).graph.initializer}


def test_api_trains_a_weight_whose_grad_name_is_taken(tmp_path):
    model = taken_grad_name_model(tmp_path / "m.onnx")
    outcome = run(RunOptions(model=model, data=data(tmp_path / "d.npz"), loss="mse",
                             optimizer="sgd", lr=0.1, steps=3, batch_size=4, quiet=True),
                  echo=lambda _line: None)
    assert outcome.graph.params == ["W", "b"]
    assert outcome.graph.grads["W"] == "W_grad_1"
    before = weights(model)
    for name in ("W", "b"):
        assert not np.allclose(outcome.result.params[name], before[name]), name


@pytest.mark.parametrize("bias", [False, True], ids=["W-only", "W-and-b"])
def test_cli_trains_a_weight_whose_grad_name_is_taken(tmp_path, bias):
    # W alone: the run stopped with "nothing to train"; with b: W was silently left out
    model = taken_grad_name_model(tmp_path / "m.onnx", bias)
    out = tmp_path / "trained.onnx"
    result = CliRunner().invoke(main, ["run", model, "--data", data(tmp_path / "d.npz"),
                                       "--loss", "mse", "--optimizer", "sgd", "--lr", "0.1",
                                       "--steps", "3", "--batch-size", "4", "-q",
                                       "-o", str(out)])
    assert result.exit_code == 0, result.output
    before, after = weights(model), weights(out)
    for name in before:
        assert not np.allclose(after[name], before[name]), name


def test_a_saved_training_graph_says_what_it_trains(tmp_path):
    """--save-graph writes the contract into the model: running the saved graph trains W,
    whose gradient output (W_grad_1) no naming convention would find."""
    model = taken_grad_name_model(tmp_path / "m.onnx", bias=False)
    npz, saved = data(tmp_path / "d.npz"), tmp_path / "training.onnx"
    common = ["--data", npz, "--optimizer", "sgd", "--lr", "0.1", "--steps", "2",
              "--batch-size", "4", "-q"]
    first = CliRunner().invoke(main, ["run", model, "--loss", "mse", "--save-graph",
                                      str(saved), *common])
    assert first.exit_code == 0, first.output
    outcome = run(RunOptions(model=str(saved), data=npz, optimizer="sgd", lr=0.1, steps=2,
                             batch_size=4, quiet=True), echo=lambda _line: None)
    assert outcome.graph.params == ["W"] and outcome.graph.grads == {"W": "W_grad_1"}
    assert not np.allclose(outcome.result.params["W"], weights(model)["W"])


def test_a_tampered_training_graph_is_one_error_line(tmp_path):
    model = taken_grad_name_model(tmp_path / "m.onnx")
    npz, saved = data(tmp_path / "d.npz"), tmp_path / "training.onnx"
    built = CliRunner().invoke(main, ["run", model, "--loss", "mse", "--steps", "1", "-q",
                                      "--batch-size", "4", "--data", npz,
                                      "--save-graph", str(saved)])
    assert built.exit_code == 0, built.output
    proto = onnx.load(saved)
    (entry,) = [p for p in proto.metadata_props if p.key == "graphopt.training_graph"]
    entry.value = entry.value.replace('"W_grad_1"', '"W_grad_7"')
    onnx.save(proto, saved)
    result = CliRunner().invoke(main, ["run", str(saved), "--data", npz, "--steps", "1",
                                       "--batch-size", "4"])
    assert result.exit_code == 1, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("graphopt: error: "), result.stderr
    assert "metadata" in lines[0] and "'W_grad_7'" in lines[0], lines[0]

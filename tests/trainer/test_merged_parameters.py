"""Parameters an exporter merged because they started equal: split by default into the
separate parameters PyTorch has, said before step 1; --no-split-shared trains each as one.

The oracle: the same model written with one initializer per module (what an exporter writes
when the values differ). Both merged forms, TorchScript's ``Identity(l0.scale) -> l1.scale``
and dynamo's one initializer read from two module scopes, must train with --split-shared
exactly what that model trains, loss for loss and weight for weight (by default and with
--split-shared)."""
from __future__ import annotations

import json

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from support.cli_runs import cli
from support.training_runs import write_npz

from graphopt.training.shared import NAME_SCOPES, find_merges

HIDDEN, CLASSES = 16, 5


def _model(form: str) -> onnx.ModelProto:
    """x -> Tanh(x * l0.scale) @ w0 -> Tanh(. * l1.scale) @ head: two all-ones scales."""
    rng = np.random.default_rng(0)
    ones = np.ones(HIDDEN, np.float32)
    inits = [numpy_helper.from_array((rng.standard_normal((HIDDEN, HIDDEN)) * 0.3)
                                     .astype(np.float32), "l0.w"),
             numpy_helper.from_array((rng.standard_normal((HIDDEN, CLASSES)) * 0.3)
                                     .astype(np.float32), "head.w"),
             numpy_helper.from_array(ones, "l0.scale")]
    second_scale = "l1.scale"
    nodes = []
    if form == "separate":
        inits.append(numpy_helper.from_array(ones.copy(), "l1.scale"))
    elif form == "identity":
        nodes.append(helper.make_node("Identity", ["l0.scale"], ["l1.scale"]))
    else:   # dynamo: one tensor, readers in two module scopes
        second_scale = "l0.scale"
    first = helper.make_node("Mul", ["x", "l0.scale"], ["a0"], name="mul")
    second = helper.make_node("Mul", ["h0", second_scale], ["a1"], name="mul_1")
    if form == "scoped":
        first.metadata_props.add(key=NAME_SCOPES, value="['', 'l0', 'mul']")
        second.metadata_props.add(key=NAME_SCOPES, value="['', 'l1', 'mul_1']")
    nodes += [first, helper.make_node("Tanh", ["a0"], ["t0"]),
              helper.make_node("MatMul", ["t0", "l0.w"], ["h0"]), second,
              helper.make_node("Tanh", ["a1"], ["t1"]),
              helper.make_node("MatMul", ["t1", "head.w"], ["logits"])]
    graph = helper.make_graph(
        nodes, "m", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", HIDDEN])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["n", CLASSES])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


@pytest.fixture
def data(tmp_path):
    rng = np.random.default_rng(2)
    return write_npz(tmp_path / "d.npz", {
        "x": rng.standard_normal((12, HIDDEN)).astype(np.float32),
        "labels": rng.integers(0, CLASSES, 12).astype(np.int64)})


def _train(tmp_path, form, data, *extra):
    path = tmp_path / f"{form}-model.onnx"
    onnx.save(_model(form), str(path))
    out, log = tmp_path / f"{form}{len(extra)}.onnx", tmp_path / f"{form}{len(extra)}.jsonl"
    code, stdout, stderr = cli("run", path, "--data", data, "--loss", "cross_entropy",
                               "--steps", 4, "--batch-size", 12, "--optimizer", "sgd", "--lr",
                               "0.5", "--device", "cpu", "-o", out, "--log", log, *extra)
    assert code == 0, stderr
    losses = [json.loads(line)["loss"] for line in open(log)]
    weights = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(out)).graph.initializer}
    return losses, weights, stdout


@pytest.mark.parametrize("extra", [(), ("--split-shared",)])
@pytest.mark.parametrize("form", ["identity", "scoped"])
def test_split_shared_trains_what_separate_parameters_train(tmp_path, data, form, extra):
    reference, separate, _ = _train(tmp_path, "separate", data)
    losses, weights, stdout = _train(tmp_path, form, data, *extra)
    assert "split 1 merged tensor(s) into 2, one per module" in stdout
    assert losses == reference
    for name in ("l0.scale", "l1.scale", "l0.w", "head.w"):
        np.testing.assert_array_equal(weights[name], separate[name], err_msg=name)
    assert not np.array_equal(weights["l0.scale"], weights["l1.scale"])


@pytest.mark.parametrize("form", ["identity", "scoped"])
def test_no_split_shared_trains_a_merged_parameter_as_one_and_says_so(tmp_path, data, form):
    reference, _, _ = _train(tmp_path, "separate", data)
    losses, _, stdout = _train(tmp_path, form, data, "--no-split-shared")
    assert ("note: 1 trained tensor(s) stand for the parameters of several modules: l0.scale "
            "(all 1) stands for 2 parameters: l0.scale, l1.scale") in stdout
    assert "--no-split-shared" in stdout
    assert losses[0] == reference[0] and losses[1] != reference[1]   # one tensor, summed


def test_distinct_values_and_unscoped_readers_are_not_merges():
    model = _model("scoped")
    scales = [t for t in model.graph.initializer if t.name == "l0.scale"][0]
    scales.CopyFrom(numpy_helper.from_array(np.arange(HIDDEN, dtype=np.float32), "l0.scale"))
    assert find_merges(model, ["l0.scale"]) == []      # a shared tensor of distinct values
    unscoped = _model("scoped")
    for node in unscoped.graph.node:
        del node.metadata_props[:]
    assert find_merges(unscoped, ["l0.scale"]) == []   # nothing says two modules read it

"""The zero biases the dynamo exporter dropped come back as the parameters PyTorch trains:
a Gemm's C, a LayerNormalization's B, a Conv's bias and a MatMul's Add, each where the node's
fx_node metadata says the call read the module's bias placeholder."""
from __future__ import annotations

import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from support.training_runs import FIXTURES, write_npz

from graphopt.trainer import RunOptions, run
from graphopt.training.dropped_biases import restore_dropped_biases
from graphopt.training.shared import FX_NODE, NAME_SCOPES


def _tag(node, module: str, call: str) -> onnx.NodeProto:
    node.metadata_props.add(key=NAME_SCOPES, value=repr(["", module, call]))
    placeholder = "p_" + module.replace(".", "_")
    node.metadata_props.add(key=FX_NODE, value=(
        f"%{call} : [num_users=1] = call_function[target=torch.ops.aten.linear.default]"
        f"(args = (%x, %{placeholder}_weight, %{placeholder}_bias), kwargs = {{}})"))
    return node


def _model(with_placeholder: bool = True) -> onnx.ModelProto:
    """x [2, 3, 4] -> MatMul(proj.weight [4, 5]) (a Linear on a 3-D input, its zero bias's
    Add removed) -> the output."""
    matmul = helper.make_node("MatMul", ["x", "proj.weight"], ["y"], name="node_linear")
    if with_placeholder:
        _tag(matmul, "proj", "linear")
    graph = helper.make_graph(
        [matmul], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, 5])],
        [numpy_helper.from_array(np.full((4, 5), 0.1, np.float32), "proj.weight")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


def test_a_matmul_gets_its_bias_add_back():
    model = _model()
    assert restore_dropped_biases(model) == ["proj.bias"]
    ops = [(n.op_type, list(n.input), list(n.output)) for n in model.graph.node]
    assert ops[0][0] == "MatMul" and ops[1][0] == "Add"
    assert ops[1][1][1] == "proj.bias" and ops[1][2] == ["y"]      # the output keeps its name
    bias = next(t for t in model.graph.initializer if t.name == "proj.bias")
    np.testing.assert_array_equal(numpy_helper.to_array(bias), np.zeros(5, np.float32))
    onnx.checker.check_model(model)
    assert restore_dropped_biases(model) == []                     # once


def test_without_the_placeholder_nothing_is_added():
    model = _model(with_placeholder=False)
    assert restore_dropped_biases(model) == []
    assert len(model.graph.node) == 1


@pytest.mark.parametrize("family,restored", [("gpt2", 8), ("vit", 2)])
def test_the_written_model_holds_the_trained_biases(tmp_path, family, restored):
    """The -o model has the restored biases, trained (no longer zero), and onnxruntime runs
    it."""
    ort = pytest.importorskip("onnxruntime")
    data = np.load(os.path.join(FIXTURES, f"family_{family}.npz"))
    names = ["pixel_values"] if family == "vit" else ["input_ids"]
    out = tmp_path / "trained.onnx"
    lines = []
    run(RunOptions(model=os.path.join(FIXTURES, f"family_{family}_dynamo18.onnx"),
                   data=write_npz(tmp_path / "d.npz", {**{n: data[n] for n in names},
                                                        "labels": data["labels"]}),
                   loss="cross_entropy", steps=2, batch_size=len(data["labels"]),
                   optimizer="sgd", lr=0.5, device="cpu", output=str(out)),
        echo=lines.append)
    said = next(line for line in lines if line.startswith("restored "))
    assert said.startswith(f"restored {restored} zero bias(es) the exporter dropped")
    written = onnx.load(str(out))
    biases = {t.name: numpy_helper.to_array(t) for t in written.graph.initializer
              if t.name.endswith(".bias")}
    moved = [name for name, value in biases.items() if np.any(value != 0)]
    assert len(moved) >= restored
    ort.InferenceSession(str(out), providers=["CPUExecutionProvider"]).run(
        None, {n: data[n] for n in names})

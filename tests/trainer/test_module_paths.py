"""Weights an exporter renamed (TorchScript's onnx::MatMul_N, a Linear's weight transposed)
are known by their module path: the node reading one names its module
(/model/layers.0/self_attn/q_proj/MatMul), so --freeze/--train patterns and the listing use
the name PyTorch's named_parameters() gives it."""
from __future__ import annotations

import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from support.cli_runs import cli
from support.training_runs import FIXTURES

from graphopt.training.module_paths import NAME_SCOPES, module_paths
from graphopt.training.prepare import trained_params

PHI3_TS = os.path.join(FIXTURES, "hf_phi3_ts17.onnx")


def test_torchscript_weights_get_their_module_paths():
    paths = module_paths(onnx.load(PHI3_TS))
    assert paths["onnx::MatMul_664"] == "inner.model.layers.0.self_attn.qkv_proj.weight"
    assert paths["onnx::MatMul_713"] == "inner.model.layers.0.self_attn.o_proj.weight"
    assert len(set(paths.values())) == len(paths) == 9


def test_freezing_a_layer_by_its_path_freezes_its_renamed_weights():
    forward = onnx.load(PHI3_TS)
    paths = module_paths(forward)
    everything = trained_params(forward)
    frozen = set(everything) - set(trained_params(forward, freeze=["*layers.0.*"]))
    assert {n for n in frozen if n.startswith("onnx::")} == \
        {n for n, p in paths.items() if ".layers.0." in p}
    assert {"inner.model.layers.0.input_layernorm.weight"} < frozen
    assert not any(".layers.1." in paths.get(n, n) for n in frozen)
    # one weight by its exact module path
    left = trained_params(forward, freeze=["inner.model.layers.1.mlp.down_proj.weight"])
    gone = set(everything) - set(left)
    assert [paths[n] for n in gone] == ["inner.model.layers.1.mlp.down_proj.weight"]


def test_the_listing_shows_module_paths():
    code, out, err = cli("run", PHI3_TS, "--loss", "cross_entropy", "--list-params")
    assert code == 0, err
    assert "inner.model.layers.*.self_attn.qkv_proj.weight (x2)" in out
    assert "onnx::MatMul_664 = inner.model.layers.0.self_attn.qkv_proj.weight" in out


def _scoped_model(scopes_a, scopes_b) -> onnx.ModelProto:
    w = numpy_helper.from_array(np.ones((4, 4), np.float32), "val_7")
    nodes = [helper.make_node("MatMul", ["x", "val_7"], ["y"], name="node_MatMul_1"),
             helper.make_node("MatMul", ["y", "val_7"], ["z"], name="node_MatMul_2")]
    for node, scopes in zip(nodes, (scopes_a, scopes_b), strict=True):
        node.metadata_props.add(key=NAME_SCOPES, value=repr(scopes))
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [2, 4])], [helper.make_tensor_value_info(
            "z", TensorProto.FLOAT, [2, 4])], [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("second,expected", [
    (["", "encoder", "encoder.proj", "matmul_1"], {"val_7": "encoder.proj.weight"}),  # one
    (["", "decoder", "decoder.proj", "matmul_1"], {}),                             # two
])
def test_dynamo_name_scopes_name_a_weight_read_by_one_module(second, expected):
    model = _scoped_model(["", "encoder", "encoder.proj", "matmul"], second)
    assert module_paths(model) == expected

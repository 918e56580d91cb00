"""Activation recomputation (``--recompute layers``): each layer's activations are computed
again in the backward pass instead of kept, and training gives the same bits."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from support import hf_families
from support.cli_runs import assert_one_error_line, cli

from graphopt.errors import GraphoptError
from graphopt.executor import Session
from graphopt.trainer import build
from graphopt.training.recompute import SUFFIX, layer_of, recompute_layers

FAMILIES = ["hf_falcon_mqa_ts17", "hf_gpt2_ts17", "hf_phi3_ts17"]


def train(model: onnx.ModelProto, data, meta, recompute: str, steps: int | None = None):
    """(losses, final weights, live tensor bytes after each node from the YieldOp on, in the
    first step, the graph)."""
    vocab = data["logits"].shape[-1]
    graph = build(hf_families.flattened_logits(model, vocab), loss="cross_entropy",
                  labels="labels", freeze=["*"], train=meta["trainable"], recompute=recompute)
    session = Session(graph.proto, device="cpu", numerics=None, training=True)
    params = dict(graph.initial)
    feeds = {"input_ids": data["train_input_ids"], "labels": data["train_labels"].reshape(-1)}
    losses, live = [], []

    every = [o for n in graph.proto.graph.node for o in n.output if o]
    sizes = {name: value.nbytes for name, value in session.run(
        {**feeds, **params}, every).items()}

    def observe(_step, name, names):
        if live or "Yield" in name:
            live.append(sum(sizes.get(n, 0) for n in names))

    for step in range(steps or meta["train_steps"]):
        out = session.run({**feeds, **params}, graph.losses + list(graph.grads.values()),
                          observer=observe if step == 0 else None)
        losses.append(float(out[graph.losses[0]]))
        for param, grad in graph.grads.items():
            params[param] = params[param] - np.float32(meta["train_lr"]) * out[grad]
    return losses, params, live, graph


@pytest.mark.parametrize("name", FAMILIES)
def test_recomputed_layers_train_to_the_same_bits_with_fewer_tensors_kept(name):
    path, data, meta = hf_families.load(name)
    kept_losses, kept_weights, kept_live, _ = train(onnx.load(path), data, meta, "none")
    losses, weights, live, graph = train(onnx.load(path), data, meta, "layers")
    assert graph.recomputation is not None and len(graph.recomputation.layers) == 2
    assert losses == kept_losses
    np.testing.assert_allclose(losses, data["torch_losses"], rtol=1e-5)
    for param, value in kept_weights.items():
        np.testing.assert_array_equal(weights[param], value)
    # the backward pass starts with less memory held, and its peak is lower: the layers'
    # activations died in the forward pass, one layer's at a time are computed again
    assert live[0] < 0.8 * kept_live[0]
    assert max(live) < max(kept_live)


def test_the_stash_is_read_only_by_its_copies_after_the_yield():
    path, data, meta = hf_families.load("hf_falcon_mqa_ts17")
    _, _, _, graph = train(onnx.load(path), data, meta, "layers", steps=1)
    nodes = list(graph.proto.graph.node)
    yield_at = next(i for i, n in enumerate(nodes) if n.op_type == "YieldOp")
    stashed = {t for stash in graph.recomputation.layers.values() for t in stash}
    after = [n for n in nodes[yield_at + 1:]]
    assert not stashed & {name for n in after for name in n.input}
    copies = [n for n in after if n.name.endswith(SUFFIX) or SUFFIX + "_" in n.name]
    assert len(copies) == graph.recomputation.copied_nodes
    # the copies compute forward values: no backward-pass mark
    assert all(a.name != "__backwardpass" or a.i == 0 for n in copies for a in n.attribute)


def test_dynamo_name_scopes_name_the_layers():
    path, data, meta = hf_families.load("hf_falcon_mqa_ts17")
    model = onnx.load(path)
    for index, node in enumerate(model.graph.node):
        parts = [p for p in node.name.split("/") if p]
        scopes = [""] + [".".join(parts[:k]) for k in range(1, len(parts))] + [parts[-1]
                                                                               if parts else ""]
        entry = node.metadata_props.add()
        entry.key, entry.value = "pkg.torch.onnx.name_scopes", repr(scopes)
        node.name = f"node_{node.op_type}_{index}"
    assert layer_of(model.graph.node[40]) in {None, "inner.transformer.h.0",
                                              "inner.transformer.h.1"}
    kept_losses, _, _, _ = train(onnx.load(path), data, meta, "none")
    losses, _, _, graph = train(model, data, meta, "layers")
    assert set(graph.recomputation.layers) == {"inner.transformer.h.0", "inner.transformer.h.1"}
    assert losses == kept_losses


def _dropout_model() -> onnx.ModelProto:
    """Two numbered blocks, each MatMul -> Dropout (training mode) -> Relu -> square, summed
    to a loss."""
    rng = np.random.default_rng(0)
    weights = [numpy_helper.from_array(rng.standard_normal((8, 8)).astype(np.float32),
                                       f"blocks.{k}.weight") for k in range(2)]
    nodes, source = [], "x"
    for k in range(2):
        scope = f"/blocks.{k}"
        nodes += [helper.make_node("MatMul", [source, f"blocks.{k}.weight"], [f"m{k}"],
                                   name=f"{scope}/MatMul"),
                  helper.make_node("Dropout", [f"m{k}", "ratio", "training"], [f"d{k}", f"k{k}"],
                                   name=f"{scope}/Dropout"),
                  helper.make_node("Relu", [f"d{k}"], [f"r{k}"], name=f"{scope}/Relu"),
                  # the square's gradient reads the Relu's result: the layer's stash
                  helper.make_node("Mul", [f"r{k}", f"r{k}"], [f"h{k}"], name=f"{scope}/Mul")]
        source = f"h{k}"
    nodes.append(helper.make_node("ReduceSum", [source], ["loss"], keepdims=0, name="/loss"))
    graph = helper.make_graph(
        nodes, "blocks", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        weights + [numpy_helper.from_array(np.array(0.5, np.float32), "ratio"),
                   numpy_helper.from_array(np.array(True), "training")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_random_ops_are_not_drawn_twice():
    x = np.random.default_rng(1).standard_normal((4, 8)).astype(np.float32)
    results = {}
    for mode in ("none", "layers"):
        graph = build(_dropout_model(), train=["blocks.*"], recompute=mode)
        session = Session(graph.proto, device="cpu", numerics=None, training=True, seed=3)
        out = session.run({"x": x, **graph.initial}, graph.losses + list(graph.grads.values()))
        results[mode] = out
        if mode == "layers":
            assert graph.recomputation.copied_nodes > 0
            copied = {n.op_type for n in graph.proto.graph.node if SUFFIX in n.name}
            assert "Dropout" not in copied
    for name, value in results["none"].items():
        np.testing.assert_array_equal(results["layers"][name], value)


def test_a_graph_without_layers_is_refused():
    model = _dropout_model()
    for node in model.graph.node:
        node.name = node.op_type
    graph = build(model, train=["blocks.*"])
    with pytest.raises(GraphoptError, match="no forward node names a numbered module"):
        recompute_layers(graph.proto)


def test_the_command_refuses_recompute_without_layers_in_one_line(tmp_path):
    code, _, stderr = cli("run", "--example", "mqa", "--steps", "1", "--recompute", "layers",
                          "-q")
    assert_one_error_line(code, stderr, "--recompute layers")
    assert not (tmp_path / "graphopt-checkpoint").exists()

"""Tied weights the exporter wrote twice train as one parameter, as PyTorch trains them.

The oracle: the same language model written with one embedding tensor whose transpose a
``Transpose`` node makes (what an exporter keeping the tie writes). A run of the model with
the folded copy (``onnx::MatMul_N`` holding the embedding's transpose, as TorchScript writes a
tied ``lm_head``) must train exactly what the run of that model trains, loss for loss and bit
for bit, and write the copy back as the trained embedding's transpose. ``--untie`` trains the
two apart (more weights, other losses from the second step on)."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from support.cli_runs import cli
from support.training_runs import write_npz

from graphopt.training.ties import MIN_ELEMENTS, find_ties

VOCAB, HIDDEN, SEQ = 64, 32, 8


def _lm(folded: bool, seed: int = 0) -> onnx.ModelProto:
    """ids -> embedding -> Tanh(x @ w) -> logits through the embedding's transpose."""
    rng = np.random.default_rng(seed)
    embedding = (rng.standard_normal((VOCAB, HIDDEN)) * 0.1).astype(np.float32)
    w = (rng.standard_normal((HIDDEN, HIDDEN)) * 0.2).astype(np.float32)
    inits = [numpy_helper.from_array(embedding, "model.embed.weight"),
             numpy_helper.from_array(w, "model.layer.weight")]
    nodes = [helper.make_node("Gather", ["model.embed.weight", "input_ids"], ["x"]),
             helper.make_node("MatMul", ["x", "model.layer.weight"], ["h0"]),
             helper.make_node("Tanh", ["h0"], ["h"])]
    if folded:
        inits.append(numpy_helper.from_array(np.ascontiguousarray(embedding.T),
                                             "onnx::MatMul_7"))
        nodes.append(helper.make_node("MatMul", ["h", "onnx::MatMul_7"], ["logits"]))
    else:
        nodes += [helper.make_node("Transpose", ["model.embed.weight"], ["head"],
                                   perm=[1, 0]),
                  helper.make_node("MatMul", ["h", "head"], ["logits"])]
    graph = helper.make_graph(
        nodes, "lm", [helper.make_tensor_value_info("input_ids", TensorProto.INT64,
                                                    ["b", SEQ])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", SEQ, VOCAB])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


@pytest.fixture
def files(tmp_path):
    rng = np.random.default_rng(5)
    ids = rng.integers(0, VOCAB, (8, SEQ)).astype(np.int64)
    data = write_npz(tmp_path / "d.npz", {"input_ids": ids, "labels": np.roll(ids, -1, 1)})
    paths = {}
    for kind in ("folded", "shared"):
        paths[kind] = str(tmp_path / f"{kind}-model.onnx")
        onnx.save(_lm(kind == "folded"), paths[kind])
    return paths, data


def _train(model, data, out, *extra):
    log = str(out) + ".jsonl"
    code, stdout, stderr = cli("run", model, "--data", data, "--loss", "cross_entropy",
                               "--labels", "labels", "--steps", 4, "--batch-size", 8,
                               "--optimizer", "sgd", "--lr", "0.5", "--device", "cpu",
                               "-o", out, "--log", log, *extra)
    assert code == 0, stderr
    import json
    losses = [json.loads(line)["loss"] for line in open(log)]
    weights = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(out)).graph.initializer}
    return losses, weights, stdout


def test_a_folded_tied_copy_trains_as_the_one_tensor_it_copies(files, tmp_path):
    paths, data = files
    tied_losses, tied, stdout = _train(paths["folded"], data, tmp_path / "tied.onnx")
    shared_losses, shared, _ = _train(paths["shared"], data, tmp_path / "shared.onnx")
    assert "tied: onnx::MatMul_7 = model.embed.weight^T" in stdout
    assert f"trained: 2 tensors, {VOCAB * HIDDEN + HIDDEN * HIDDEN:,} weights" in stdout
    assert tied_losses == shared_losses
    np.testing.assert_array_equal(tied["model.embed.weight"], shared["model.embed.weight"])
    np.testing.assert_array_equal(tied["model.layer.weight"], shared["model.layer.weight"])
    # written back tied: the copy is the trained embedding's transpose, as in the input model
    np.testing.assert_array_equal(tied["onnx::MatMul_7"], tied["model.embed.weight"].T)
    start = numpy_helper.to_array(_lm(True).graph.initializer[0])
    assert not np.array_equal(tied["model.embed.weight"], start)


def test_untie_trains_the_copy_apart(files, tmp_path):
    paths, data = files
    tied_losses, _, _ = _train(paths["folded"], data, tmp_path / "tied.onnx")
    apart_losses, apart, stdout = _train(paths["folded"], data, tmp_path / "apart.onnx",
                                         "--untie")
    assert "tied:" not in stdout and "trained: 3 tensors" in stdout
    assert apart_losses[0] == tied_losses[0] and apart_losses[1] != tied_losses[1]
    assert not np.array_equal(apart["onnx::MatMul_7"], apart["model.embed.weight"].T)


def test_list_params_names_the_tie(files):
    paths, _ = files
    code, stdout, stderr = cli("run", paths["folded"], "--list-params")
    assert code == 0, stderr
    assert "tied: onnx::MatMul_7 = model.embed.weight^T" in stdout
    code, stdout, _ = cli("run", paths["folded"], "--list-params", "--untie")
    assert code == 0 and "tied:" not in stdout


def _model_of(tensors: dict[str, np.ndarray]) -> onnx.ModelProto:
    graph = helper.make_graph([], "g", [], [],
                              [numpy_helper.from_array(v, n) for n, v in tensors.items()])
    return helper.make_model(graph)


def test_what_is_and_is_not_taken_for_a_copy():
    rng = np.random.default_rng(0)
    a = rng.standard_normal((64, 32)).astype(np.float32)
    square = rng.standard_normal((32, 32)).astype(np.float32)
    near = a.copy()
    near[1, 1] += 1.0          # equal where the probe looks (its first points), not whole
    small = rng.standard_normal(MIN_ELEMENTS // 2).astype(np.float32)
    tensors = {
        "enc.embed.weight": a, "onnx::MatMul_1": np.ascontiguousarray(a.T),
        "h.0.w": square, "h.1.w": square.copy(), "onnx::MatMul_2": np.ascontiguousarray(
            square.T),
        "ln.0.weight": np.ones((64, 32), np.float32), "ln.1.weight": np.ones((64, 32),
                                                                             np.float32),
        "near.weight": near, "small.a": small, "small.b": small.copy()}
    ties = {t.copy: (t.source, t.transposed) for t in
            find_ties(_model_of(tensors), list(tensors))}
    assert ties == {"onnx::MatMul_1": ("enc.embed.weight", True),
                    "h.1.w": ("h.0.w", False), "onnx::MatMul_2": ("h.0.w", True)}


def test_only_trained_tensors_are_tied():
    rng = np.random.default_rng(1)
    a = rng.standard_normal((64, 32)).astype(np.float32)
    model = _model_of({"e.weight": a, "onnx::MatMul_1": np.ascontiguousarray(a.T)})
    assert find_ties(model, ["e.weight"]) == []


def test_the_training_graph_records_the_tie_and_reads_it_back(tmp_path):
    from graphopt.training import TrainingGraph
    from graphopt.training.prepare import prepare_training

    graph, _ = prepare_training(_lm(True), loss="cross_entropy", labels="labels")
    assert graph.tied == {"onnx::MatMul_7": {"source": "model.embed.weight",
                                             "transposed": True}}
    assert "onnx::MatMul_7" not in graph.params
    path = tmp_path / "training.onnx"
    onnx.save(graph.proto, str(path))
    assert TrainingGraph.from_model(onnx.load(str(path))).tied == graph.tied


def test_copies_of_1024_elements_are_found_and_of_1023_are_not():
    rng = np.random.default_rng(1)
    edge = rng.standard_normal(1024).astype(np.float32)
    under = rng.standard_normal(1023).astype(np.float32)
    tensors = {"a.weight": edge, "b.weight": edge.copy(), "c.weight": under,
               "d.weight": under.copy()}
    ties = {t.copy: t.source for t in find_ties(_model_of(tensors), list(tensors))}
    assert ties == {"b.weight": "a.weight"}

"""`--loss cross_entropy` on language-model logits [batch, seq, vocab] with labels
[batch, seq] (the class axis is the one whose removal gives the labels' shape), padded
labels ignored with --ignore-index (default -100, as PyTorch), and one precise error when the
shapes fit no layout."""
from __future__ import annotations

import numpy as np
import onnx
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper
from support.training_runs import write_npz

from graphopt.cli import main

VOCAB, HIDDEN, SEQ, SAMPLES = 11, 6, 5, 8


def lm_model(tmp_path) -> tuple[str, dict]:
    rng = np.random.default_rng(0)
    weights = {"embed.weight": rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32),
               "lm_head.weight": rng.standard_normal((HIDDEN, VOCAB)).astype(np.float32)}
    graph = helper.make_graph(
        [helper.make_node("Gather", ["embed.weight", "input_ids"], ["h"]),
         helper.make_node("MatMul", ["h", "lm_head.weight"], ["logits"])],
        "lm", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", SEQ])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", SEQ, VOCAB])],
        [numpy_helper.from_array(v, k) for k, v in weights.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    path = tmp_path / "lm.onnx"
    onnx.save(model, path)
    return str(path), weights


def cross_entropy(logits, labels, ignore):
    logits = logits - logits.max(-1, keepdims=True)
    log_prob = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    keep = labels != ignore
    picked = np.take_along_axis(log_prob, np.where(keep, labels, 0)[..., None], -1)[..., 0]
    return -(picked * keep).sum() / keep.sum()


def run(*args):
    return CliRunner().invoke(main, ["run", *[str(a) for a in args]])


def first_loss(output: str) -> float:
    line = next(line for line in output.splitlines() if line.startswith("loss: first step"))
    return float(line.split()[3].rstrip(","))


def test_lm_logits_train_with_labels_on_the_last_axis_and_padding_ignored(tmp_path):
    model, weights = lm_model(tmp_path)
    rng = np.random.default_rng(1)
    ids = rng.integers(0, VOCAB, (SAMPLES, SEQ))
    labels = rng.integers(0, VOCAB, (SAMPLES, SEQ))
    labels[:, -2:] = -100                                  # padding, as HF collators write it
    data = write_npz(tmp_path / "d.npz", {"input_ids": ids, "labels": labels})
    result = run(model, "--data", data, "--loss", "cross_entropy", "--batch-size", SAMPLES,
                 "--steps", "2", "--optimizer", "sgd", "--lr", "0.1")
    assert result.exit_code == 0, result.output
    logits = weights["embed.weight"][ids] @ weights["lm_head.weight"]
    expected = cross_entropy(logits, labels, -100)     # the whole data is the first batch
    assert abs(first_loss(result.stdout) - expected) < 1e-4
    # another ignore value: the -100 labels now count (out of range), -1 padding is ignored
    labels[:, -2:] = -1
    data = write_npz(tmp_path / "d1.npz", {"input_ids": ids, "labels": labels})
    result = run(model, "--data", data, "--loss", "cross_entropy", "--batch-size", SAMPLES,
                 "--steps", "1", "--ignore-index", "-1")
    assert result.exit_code == 0, result.output
    assert abs(first_loss(result.stdout) - cross_entropy(logits, labels, -1)) < 1e-4


def test_labels_fitting_no_layout_get_one_line_naming_the_shapes(tmp_path):
    model, _ = lm_model(tmp_path)
    data = write_npz(tmp_path / "d.npz", {"input_ids": np.zeros((SAMPLES, SEQ), np.int64),
                                          "labels": np.zeros((SAMPLES, SEQ - 1), np.int64)})
    result = run(model, "--data", data, "--loss", "cross_entropy", "--batch-size", "4",
                 "--steps", "1")
    assert result.exit_code == 1, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert f"the logits 'logits' are [batch, {SEQ}, {VOCAB}]" in lines[0]
    assert f"'labels' [batch, {SEQ - 1}]" in lines[0]
    assert f"[batch, {SEQ}] (classes on axis 2)" in lines[0]

"""transformers' Trainer conventions: gradient accumulation (the mean of the micro-batches'
gradients: a step of B x N samples, whatever N), weight decay on the tensors of rank >= 2
only, perplexity and accuracy beside the loss.

The truth for accumulation is PyTorch's: the MLP fixture trained with batch 4 by torch
(tests/fixtures/make_torch_truth.py); mean cross-entropy over 2 micro-batches of 2 is the
same mean over the 4 samples, so graphopt with --batch-size 2 --grad-accum 2 must give it."""
from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
from support.cli_runs import cli
from support.training_runs import FIXTURES, in_epoch_order, mlp_with_dynamic_batch, write_npz

from graphopt.trainer import RunOptions, run

TRAINING = np.load(os.path.join(FIXTURES, "torch_training.npz"))
META = json.loads(str(TRAINING["__meta__"]))["mlp"]


@pytest.fixture
def mlp(tmp_path) -> str:
    return mlp_with_dynamic_batch(tmp_path)


def _torch_order(tmp_path, batch_size: int) -> str:
    """The MLP data laid out so that graphopt's epoch-0 order hands torch's batch t (rows
    4t..4t+3) to step t, as micro-batches of ``batch_size``."""
    arrays = {"x": TRAINING["mlp/x"], "labels": TRAINING["mlp/labels"]}
    return write_npz(tmp_path / "mlp.npz", in_epoch_order(arrays, batch_size, 3))


# The first 12 of the 25 recorded steps: at step 20 of the SGD run a pre-activation lies
# within 1e-7 of ReLU's kink, where the GEMMs of a batch of 2 and of 4 may round it to either
# side (PyTorch's accumulation would be as sensitive there)
ACCUMULATED_STEPS = 12


@pytest.mark.parametrize("config", ["sgd", "adamw_wd_trainer_groups"])
def test_two_accumulated_micro_batches_equal_pytorchs_whole_batch(tmp_path, mlp, config):
    spec = META["configs"][config]
    outcome = run(RunOptions(model=mlp, data=_torch_order(tmp_path, 2), loss="cross_entropy",
                             steps=ACCUMULATED_STEPS, batch_size=2, grad_accum=2,
                             optimizer=spec["optimizer"], lr=spec["lr"],
                             weight_decay=spec["weight_decay"],
                             weight_decay_all=spec.get("decay_all", True), seed=3,
                             device="cpu", quiet=True))
    np.testing.assert_allclose(outcome.result.losses,
                               TRAINING[f"mlp/{config}/losses"][:ACCUMULATED_STEPS],
                               rtol=2e-6, atol=2e-6)


def test_accumulation_is_resumed_where_it_stopped(tmp_path, mlp):
    data = _torch_order(tmp_path, 2)
    common = dict(model=mlp, data=data, loss="cross_entropy", batch_size=2, grad_accum=3,
                  optimizer="adamw", lr=0.01, seed=3, device="cpu", quiet=True)
    straight = run(RunOptions(**common, steps=10)).result
    folder = str(tmp_path / "ckpt")
    run(RunOptions(**common, steps=4, checkpoint=folder))
    resumed = run(RunOptions(**common, steps=10, checkpoint=folder, resume=True)).result
    assert resumed.losses == straight.losses
    for name, value in straight.params.items():
        np.testing.assert_array_equal(resumed.params[name], value)
    code, _, err = cli("run", mlp, "--data", data, "--loss", "cross_entropy", "--batch-size",
                       "2", "--grad-accum", "2", "--steps", "10", "--checkpoint", folder,
                       "--resume")
    assert code == 1 and "--grad-accum 2 (the checkpoint's run: 3)" in err, err
    assert len(err.strip().splitlines()) == 1


def test_the_start_line_says_how_a_step_is_made_up(tmp_path, mlp):
    code, out, err = cli("run", mlp, "--data", _torch_order(tmp_path, 2), "--loss",
                         "cross_entropy", "--batch-size", "2", "--grad-accum", "3", "--steps",
                         "1", "--optimizer", "adamw")
    assert code == 0, err
    assert "steps of 6 (3 accumulated micro-batches of 2) (16 steps per epoch)" in out
    assert "weight decay 0.01 on the 2 tensors of rank >= 2" in out


@pytest.mark.parametrize("value", ["0", "-2", "60"])
def test_a_bad_accumulation_is_one_line(tmp_path, mlp, value):
    code, _, err = cli("run", mlp, "--data", _torch_order(tmp_path, 2), "--loss",
                       "cross_entropy", "--batch-size", "2", "--grad-accum", value)
    assert code == 1 and len(err.strip().splitlines()) == 1 and "--grad-accum" in err, err


def test_each_step_logs_the_perplexity_of_its_cross_entropy(tmp_path, mlp):
    log = tmp_path / "log.jsonl"
    result = run(RunOptions(model=mlp, data=_torch_order(tmp_path, 4), loss="cross_entropy",
                            steps=3, batch_size=4, seed=3, device="cpu", quiet=True,
                            log=str(log))).result
    for record in result.history:
        assert record["perplexity"] == pytest.approx(math.exp(record["loss"]), rel=1e-12)
    logged = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["perplexity"] for r in logged] == [r["perplexity"] for r in result.history]


def test_a_loss_that_is_no_cross_entropy_logs_no_perplexity(tmp_path, mlp):
    rng = np.random.default_rng(1)
    data = write_npz(tmp_path / "mse.npz", {
        "x": rng.standard_normal((8, 64)).astype(np.float32),
        "target": rng.standard_normal((8, 10)).astype(np.float32)})
    result = run(RunOptions(model=mlp, data=data, loss="mse", labels="target", steps=2,
                            batch_size=4, device="cpu", quiet=True)).result
    assert all("perplexity" not in record for record in result.history)


def test_held_out_accuracy_and_perplexity_are_those_of_the_written_model(tmp_path, mlp):
    """The last evaluation against onnxruntime running the trained model -o wrote on the same
    held-out rows: mean cross-entropy, exp of it, and argmax accuracy, the rows labelled -100
    counted by neither."""
    ort = pytest.importorskip("onnxruntime")
    rng = np.random.default_rng(2)
    x = rng.standard_normal((12, 64)).astype(np.float32)
    labels = rng.integers(0, 10, 12).astype(np.int64)
    labels[[1, 7]] = -100
    held_out = write_npz(tmp_path / "held_out.npz", {"x": x, "labels": labels})
    out = tmp_path / "trained.onnx"
    outcome = run(RunOptions(model=mlp, data=_torch_order(tmp_path, 4), loss="cross_entropy",
                             steps=6, batch_size=4, seed=3, device="cpu", quiet=True,
                             eval_data=held_out, eval_every=3, output=str(out)))
    last = outcome.result.history[-1]
    logits = ort.InferenceSession(str(out)).run(None, {"x": x})[0].astype(np.float64)
    counted = labels != -100
    shifted = logits - logits.max(axis=1, keepdims=True)
    log_probs = shifted - np.log(np.exp(shifted).sum(axis=1, keepdims=True))
    # the evaluation's batches are of --batch-size rows: the mean of the batch means
    batch_losses = [-log_probs[rows][counted[rows], labels[rows][counted[rows]]].mean()
                    for rows in (slice(0, 4), slice(4, 8), slice(8, 12))]
    expected_loss = float(np.mean(batch_losses))
    assert last["eval_loss"] == pytest.approx(expected_loss, rel=1e-5)
    assert last["eval_perplexity"] == pytest.approx(math.exp(last["eval_loss"]), rel=1e-12)
    accuracy = (logits.argmax(axis=1) == labels)[counted].mean()
    assert last["eval_accuracy"] == pytest.approx(accuracy, abs=1e-12)

"""transformers' Trainer conventions: gradient accumulation (the mean of the micro-batches'
gradients: a step of B x N samples, whatever N), weight decay on the tensors of rank >= 2
only, perplexity and accuracy beside the loss.

The truth for accumulation is PyTorch's: the MLP fixture trained with batch 4 by torch
(tests/fixtures/make_torch_truth.py); mean cross-entropy over 2 micro-batches of 2 is the
same mean over the 4 samples, so graphopt with --batch-size 2 --grad-accum 2 must give it."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
from support.cli_runs import cli
from support.training_runs import FIXTURES, mlp_with_dynamic_batch, write_npz

from graphopt.trainer import RunOptions, run
from graphopt.trainer.data import Batches

TRAINING = np.load(os.path.join(FIXTURES, "torch_training.npz"))
META = json.loads(str(TRAINING["__meta__"]))["mlp"]


@pytest.fixture
def mlp(tmp_path) -> str:
    return mlp_with_dynamic_batch(tmp_path)


def _torch_order(tmp_path, batch_size: int) -> str:
    """The MLP data laid out so that graphopt's epoch-0 order hands torch's batch t (rows
    4t..4t+3) to step t, as micro-batches of ``batch_size``."""
    arrays = {"x": TRAINING["mlp/x"], "labels": TRAINING["mlp/labels"]}
    n = len(arrays["x"])
    order = Batches(arrays, list(arrays), batch_size, 3).order(0)
    laid_out = {}
    for name, value in arrays.items():
        placed = np.empty_like(value)
        placed[order[:n]] = value
        laid_out[name] = placed
    return write_npz(tmp_path / "mlp.npz", laid_out)


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

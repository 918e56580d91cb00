"""BatchNorm trained as ``model.train()`` trains it: batch statistics forward, the running
statistics updated every step (unbiased variance, PyTorch's momentum), the gradient through
the batch statistics; a held-out evaluation, the model written by -o and a resumed run
carry the running statistics on.

The truth is tests/fixtures/make_batchnorm_fixtures.py's: a small CNN with two BatchNorm2d
layers exported in eval mode by both exporters, and torch.optim.SGD(momentum=0.9) on it."""
from __future__ import annotations

import json
import os

import numpy as np
import onnx
import pytest
from onnx import numpy_helper
from support.cli_runs import cli
from support.training_runs import FIXTURES, in_epoch_order, write_npz

from graphopt.trainer import RunOptions, run
from graphopt.trainer.data import Batches

TRUTH = np.load(os.path.join(FIXTURES, "cnn_bn_truth.npz"))
META = json.loads(str(TRUTH["__meta__"]))
SEED = 3
EXPORTS = ["cnn_bn_ts17.onnx", "cnn_bn_dynamo18.onnx"]


def _data(tmp_path) -> str:
    return write_npz(tmp_path / "train.npz", in_epoch_order(
        {"x": TRUTH["x"], "labels": TRUTH["labels"]}, META["batch_size"], SEED))


def _options(tmp_path, model: str, **overrides) -> RunOptions:
    settings = dict(model=os.path.join(FIXTURES, model), data=_data(tmp_path),
                    loss=META["loss"], steps=META["steps"], batch_size=META["batch_size"],
                    optimizer=META["optimizer"], lr=META["lr"], weight_decay=0.0, seed=SEED,
                    device="cpu", quiet=True)
    return RunOptions(**{**settings, **overrides})


@pytest.mark.parametrize("model", EXPORTS)
def test_losses_weights_and_running_statistics_equal_pytorch(tmp_path, model):
    result = run(_options(tmp_path, model)).result
    np.testing.assert_allclose(result.losses, TRUTH["losses"], rtol=1e-6, atol=1e-6)
    assert sorted(result.params) == sorted(META["params"])
    for name in META["params"]:
        np.testing.assert_allclose(result.params[name], TRUTH[f"final/{name}"], rtol=1e-5,
                                   atol=1e-6, err_msg=name)
    statistics = [n for n in META["buffers"] if "running" in n]
    assert sorted(result.buffers) == sorted(statistics)
    for name in statistics:
        np.testing.assert_allclose(result.buffers[name], TRUTH[f"final/{name}"], rtol=1e-6,
                                   atol=1e-7, err_msg=name)


def test_held_out_evaluation_normalises_with_the_running_statistics(tmp_path):
    """model.eval()'s loss after training: the updated running statistics, not the batch's."""
    held_out = write_npz(tmp_path / "held_out.npz", {"x": TRUTH["held_out"],
                                                      "labels": TRUTH["held_out_labels"]})
    result = run(_options(tmp_path, EXPORTS[0], eval_data=held_out,
                          eval_every=META["steps"])).result
    np.testing.assert_allclose(result.history[-1]["eval_loss"], float(TRUTH["eval_loss"]),
                               rtol=1e-6)


def test_the_written_model_holds_the_updated_statistics(tmp_path):
    out = tmp_path / "trained.onnx"
    run(_options(tmp_path, EXPORTS[0], output=str(out)))
    written = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(out)).graph.initializer}
    for name in META["params"] + META["buffers"]:
        if name in written:
            np.testing.assert_allclose(written[name], TRUTH[f"final/{name}"], rtol=1e-5,
                                       atol=1e-6, err_msg=name)
    assert {"bn1.running_mean", "bn2.running_var"} <= set(written)
    # still the eval-mode model the user exported: BatchNormalization, no training op
    ops = {n.op_type for n in onnx.load(str(out)).graph.node}
    assert "BatchNormalization" in ops and "BatchNormInternal" not in ops


def test_a_resumed_run_continues_the_running_statistics(tmp_path):
    straight = run(_options(tmp_path, EXPORTS[0])).result
    checkpoint = str(tmp_path / "ckpt")
    run(_options(tmp_path, EXPORTS[0], steps=2, checkpoint=checkpoint))
    resumed = run(_options(tmp_path, EXPORTS[0], checkpoint=checkpoint, resume=True)).result
    assert resumed.losses == straight.losses
    for name, value in straight.buffers.items():
        np.testing.assert_array_equal(resumed.buffers[name], value, err_msg=name)


def test_listing_trains_the_batch_norm_affine_and_updates_its_statistics(tmp_path):
    code, out, err = cli("run", os.path.join(FIXTURES, EXPORTS[0]), "--loss", "cross_entropy",
                         "--list-params")
    assert code == 0, err
    assert "bn1.weight" in out and "bn2.bias" in out
    updated = next(line for line in out.splitlines() if line.startswith("running statistics"))
    assert "bn1.running_mean" in updated and "bn2.running_var" in updated
    assert not any(line.startswith("not trained") for line in out.splitlines())


def test_a_batch_norm_folded_into_its_conv_trains_the_conv_bias(tmp_path):
    """TorchScript's constant folding leaves each Conv a new weight and bias named
    onnx::Conv_*: both are the layer's parameters."""
    model = onnx.load(os.path.join(FIXTURES, "cnn_bn_folded_ts17.onnx"))
    conv_inputs = [name for node in model.graph.node if node.op_type == "Conv"
                   for name in node.input[1:]]
    assert all(name.startswith("onnx::Conv_") for name in conv_inputs)
    result = run(_options(tmp_path, "cnn_bn_folded_ts17.onnx", steps=1)).result
    assert set(conv_inputs) <= set(result.params)


def test_a_skipped_accumulated_step_keeps_the_running_statistics(tmp_path):
    """The first micro-batch is finite and updates the statistics, the second overflows:
    the step is skipped, and the statistics are what they were before it."""
    x, labels = TRUTH["x"][:8].copy(), TRUTH["labels"][:8]
    second = Batches({"x": x}, ["x"], 4, SEED, accumulate=2).rows(0, 1)
    x[second[0]] = np.inf
    data = write_npz(tmp_path / "overflow.npz", {"x": x, "labels": labels})
    model = os.path.join(FIXTURES, EXPORTS[0])
    result = run(RunOptions(model=model, data=data, loss="cross_entropy", steps=1,
                            batch_size=4, grad_accum=2, optimizer="sgd", lr=0.1, seed=SEED,
                            loss_scale="dynamic", device="cpu", quiet=True)).result
    assert result.skipped == 1
    initial = {t.name: numpy_helper.to_array(t) for t in onnx.load(model).graph.initializer}
    for name, value in result.buffers.items():
        np.testing.assert_array_equal(value, initial[name], err_msg=name)

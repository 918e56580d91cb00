"""What users of the HF Trainer and PyTorch Lightning reach for: --lr-schedule with --warmup
(transformers' formulas), --clip-grad-norm (torch's clip_grad_norm_), --eval-data /
--eval-every (held-out loss logged and plotted), and --plot in the extension's format with a
title that tells runs apart and a smoothed curve over the raw points."""
from __future__ import annotations

import json
import math

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import numpy_helper
from support.training_runs import MLP, mlp_data, write_npz

from graphopt.cli import main
from graphopt.trainer import RunOptions, run
from graphopt.trainer.export import smoothed
from graphopt.trainer.schedule import lr_factor


def invoke(*args):
    return CliRunner().invoke(main, ["run", *[str(a) for a in args]])


def weights(path):
    return {t.name: numpy_helper.to_array(t).astype(np.float64)
            for t in onnx.load(path).graph.initializer}


def log_records(path):
    return [json.loads(line) for line in open(path)]


@pytest.fixture
def data(tmp_path):
    return write_npz(tmp_path / "d.npz", mlp_data())


BASE = ["--loss", "cross_entropy", "--batch-size", "4", "--optimizer", "sgd"]


# ---- 7: schedules ------------------------------------------------------------------------------
def test_schedule_factors_are_transformers_formulas():
    # get_linear_schedule_with_warmup(warmup=2, total=10) at steps 0..: 0, .5, 1, 7/8, ...
    assert [lr_factor("linear", s, 10, 2) for s in (0, 1, 2, 3, 10)] == [0, 0.5, 1, 7 / 8, 0]
    assert lr_factor("cosine", 6, 10, 2) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))
    assert lr_factor("cosine", 2, 10, 2) == 1.0 and lr_factor("constant", 9, 10, 2) == 1.0


def test_lr_schedule_is_applied_and_logged(tmp_path, data):
    log = tmp_path / "log.jsonl"
    result = invoke(MLP, "--data", data, *BASE, "--lr", "0.1", "--steps", "6",
                    "--lr-schedule", "linear", "--warmup", "2", "--log", log)
    assert result.exit_code == 0, result.output
    assert "(linear schedule, warmup 2 steps)" in result.stdout
    lrs = [r["lr"] for r in log_records(log)]
    assert lrs == pytest.approx([0.0, 0.05, 0.1, 0.075, 0.05, 0.025])


def test_first_warmup_step_does_not_move_the_weights(tmp_path, data):
    out = tmp_path / "m.onnx"
    result = invoke(MLP, "--data", data, *BASE, "--lr", "0.1", "--steps", "1",
                    "--warmup", "3", "-o", out)
    assert result.exit_code == 0, result.output
    before, after = weights(MLP), weights(out)
    assert all(np.array_equal(before[n], after[n]) for n in before)


# ---- 7: gradient clipping ---------------------------------------------------------------------
def test_clip_grad_norm_bounds_the_update(tmp_path, data):
    out, log = tmp_path / "m.onnx", tmp_path / "log.jsonl"
    result = invoke(MLP, "--data", data, *BASE, "--lr", "0.5", "--steps", "1",
                    "--clip-grad-norm", "0.01", "-o", out, "--log", log)
    assert result.exit_code == 0, result.output
    before, after = weights(MLP), weights(out)
    step = math.sqrt(sum(float(np.sum((after[n] - before[n]) ** 2)) for n in before))
    assert step == pytest.approx(0.5 * 0.01, rel=1e-3)    # sgd: lr x the clipped norm
    record = log_records(log)[0]
    assert record["grad_norm"] > 0.01                       # the norm before clipping


# ---- 7: held-out data -------------------------------------------------------------------------
def with_dropout(tmp_path) -> str:
    """The MLP with a Dropout(0.5) between its layers: training drops, evaluation must not."""
    model = onnx.load(MLP)
    relu = next(n for n in model.graph.node if n.op_type == "Relu")
    second = next(n for n in model.graph.node if relu.output[0] in n.input)
    second.input[list(second.input).index(relu.output[0])] = "dropped"
    model.graph.node.insert(list(model.graph.node).index(second), onnx.helper.make_node(
        "Dropout", [relu.output[0], "ratio"], ["dropped"], name="dropout"))
    model.graph.initializer.append(numpy_helper.from_array(np.array(0.5, np.float32), "ratio"))
    path = tmp_path / "dropout.onnx"
    onnx.save(model, path)
    return str(path)


@pytest.mark.parametrize("dropout", [False, True])
def test_eval_loss_is_the_held_out_cross_entropy(tmp_path, data, dropout):
    ort = pytest.importorskip("onnxruntime")
    model = with_dropout(tmp_path) if dropout else MLP
    held_out = mlp_data(samples=12, seed=5)
    eval_data = write_npz(tmp_path / "e.npz", held_out)
    out, log = tmp_path / "m.onnx", tmp_path / "log.jsonl"
    result = invoke(model, "--data", data, *BASE, "--lr", "0.1", "--steps", "4",
                    "--eval-data", eval_data, "--eval-every", "2", "-o", out, "--log", log)
    assert result.exit_code == 0, result.output
    records = log_records(log)
    assert [r["step"] for r in records if r["eval_loss"] is not None] == [2, 4]
    assert "eval loss: last" in result.stdout
    # onnxruntime on the trained model, batch by batch (the fixture's batch is fixed at 4)
    session = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    losses = []
    for i in range(0, 12, 4):
        logits = session.run(None, {"x": held_out["x"][i:i + 4]})[0].astype(np.float64)
        logits -= logits.max(1, keepdims=True)
        log_prob = logits - np.log(np.exp(logits).sum(1, keepdims=True))
        losses.append(-log_prob[np.arange(4), held_out["labels"][i:i + 4]].mean())
    assert records[-1]["eval_loss"] == pytest.approx(np.mean(losses), rel=1e-4)


def test_eval_every_without_eval_data_is_one_line(data):
    result = invoke(MLP, "--data", data, *BASE, "--steps", "1", "--eval-every", "2")
    assert result.exit_code == 1 and "--eval-every needs --eval-data" in result.stderr


# ---- 8: plots ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name, magic", [("loss.svg", b"<svg"), ("loss.pdf", b"%PDF"),
                                         ("loss.png", b"\x89PNG")])
def test_plot_follows_the_extension(tmp_path, data, name, magic):
    pytest.importorskip("matplotlib")
    plot = tmp_path / name
    result = invoke(MLP, "--data", data, *BASE, "--steps", "3", "--plot", plot)
    assert result.exit_code == 0, result.output
    assert magic in plot.read_bytes()[:400]


def test_plot_with_an_unknown_extension_is_refused_before_training(tmp_path, data):
    result = invoke(MLP, "--data", data, *BASE, "--steps", "3", "--plot", tmp_path / "x.jpg")
    assert result.exit_code == 1 and "use a .png, .svg or .pdf" in result.stderr
    assert "step 1" not in result.stdout and not (tmp_path / "x.jpg").exists()


def test_plot_title_tells_precision_numerics_and_loss_scaling_apart(tmp_path, data):
    pytest.importorskip("matplotlib")
    base = dict(model=MLP, data=data, loss="cross_entropy", batch_size=4, steps=2,
                device="cpu", quiet=True, plot=str(tmp_path / "a.png"))
    plain = run(RunOptions(**base)).plot_title
    stalled = run(RunOptions(**{**base, "precision": "mixed", "numerics": "mi200",
                                "loss_scale": "none"})).plot_title
    assert "precision fp32, numerics native, loss scale none" in plain
    assert "precision mixed, numerics mi200, loss scale none" in stalled


def test_smoothing_is_a_debiased_moving_average():
    assert smoothed([2.0, 2.0, 2.0]) == pytest.approx([2.0, 2.0, 2.0])
    values = smoothed([1.0, 0.0], weight=0.5)
    assert values == pytest.approx([1.0, (0.25) / 0.75])


def test_schedule_clipping_and_eval_on_device_resident_weights_equal_the_host_run(tmp_path):
    """The GPU branch of the loop (weights and gradients on the device; here a stand-in
    device whose arrays are NumPy's) applies the schedule, the clipping and the evaluation
    exactly as the host does."""
    from support.cupy_api import RecordingXp

    from graphopt.executor.backend import ArrayBackend

    base = dict(model=MLP, data=write_npz(tmp_path / "d.npz", mlp_data(samples=40)),
                eval_data=write_npz(tmp_path / "e.npz", mlp_data(samples=8, seed=9)),
                loss="cross_entropy", steps=8, batch_size=4, optimizer="adamw", lr=0.01,
                lr_schedule="cosine", warmup=2, clip_grad_norm=0.5, eval_every=4, seed=5,
                quiet=True)
    host = run(RunOptions(**base, device="cpu"))
    device = run(RunOptions(**base, device=ArrayBackend("cuda", RecordingXp())))
    for name, value in host.result.params.items():
        np.testing.assert_array_equal(device.result.params[name], value, err_msg=name)
    evals = [r["eval_loss"] for r in host.result.history if "eval_loss" in r]
    assert len(evals) == 2
    assert evals == [r["eval_loss"] for r in device.result.history if "eval_loss" in r]

"""`--resume` takes the run's settings from the checkpoint (as PyTorch Lightning's ckpt_path
and the HF Trainer's resume_from_checkpoint do): a bare resume continues the same run, an
option given again with another value is one error listing the differences, and a resume
with nothing left to train says so and exits 1."""
from __future__ import annotations

import numpy as np
import onnx
from click.testing import CliRunner
from onnx import numpy_helper
from support.training_runs import MLP, mlp_data, write_npz

from graphopt.cli import main


def invoke(*args):
    return CliRunner().invoke(main, ["run", *[str(a) for a in args]])


def weights(path):
    return {t.name: numpy_helper.to_array(t) for t in onnx.load(path).graph.initializer}


SETTINGS = ["--loss", "cross_entropy", "--batch-size", "4", "--optimizer", "momentum",
            "--lr", "0.05", "--weight-decay", "0.01", "--precision", "mixed", "--loss-scale",
            "static:128", "--seed", "7"]


def test_bare_resume_continues_the_saved_run_exactly(tmp_path):
    data = write_npz(tmp_path / "d.npz", mlp_data())
    whole = invoke(MLP, "--data", data, *SETTINGS, "--steps", "6", "-o", tmp_path / "whole.onnx")
    assert whole.exit_code == 0, whole.output
    first = invoke(MLP, "--data", data, *SETTINGS, "--steps", "3",
                   "--checkpoint", tmp_path / "ck")
    assert first.exit_code == 0, first.output
    # docs/training.md's promise: only the model, the data, the checkpoint and the new length
    resumed = invoke(MLP, "--data", data, "--checkpoint", tmp_path / "ck", "--resume",
                     "--steps", "6", "-o", tmp_path / "resumed.onnx")
    assert resumed.exit_code == 0, resumed.output
    assert "resumed from" in resumed.stdout and "at step 3" in resumed.stdout
    assert "optimizer momentum lr 0.05, weight decay 0.01 on the 2 tensors of rank >= 2" \
        in resumed.stdout and "; precision mixed; loss scale static" in resumed.stdout
    expected, found = weights(tmp_path / "whole.onnx"), weights(tmp_path / "resumed.onnx")
    for name in expected:
        np.testing.assert_array_equal(found[name], expected[name], err_msg=name)


def test_resume_without_steps_keeps_the_saved_length(tmp_path):
    data = write_npz(tmp_path / "d.npz", mlp_data())
    first = invoke(MLP, "--data", data, *SETTINGS, "--steps", "4",
                   "--checkpoint", tmp_path / "ck", "--checkpoint-every", "2")
    assert first.exit_code == 0, first.output
    # finished: nothing left, said in one line with exit 1, not "training ... for 4 steps"
    done = invoke(MLP, "--data", data, "--checkpoint", tmp_path / "ck", "--resume")
    assert done.exit_code == 1, done.output
    lines = done.stderr.splitlines()
    assert len(lines) == 1 and "at step 4" in lines[0] and "nothing left to train" in lines[0]
    assert "--steps N with N > 4" in lines[0]


def test_resume_with_different_options_lists_every_difference(tmp_path):
    data = write_npz(tmp_path / "d.npz", mlp_data())
    first = invoke(MLP, "--data", data, *SETTINGS, "--steps", "2",
                   "--checkpoint", tmp_path / "ck")
    assert first.exit_code == 0, first.output
    result = invoke(MLP, "--data", data, "--checkpoint", tmp_path / "ck", "--resume",
                    "--steps", "4", "--lr", "0.1", "--precision", "fp32", "--batch-size", "4")
    assert result.exit_code == 1, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert "--lr 0.1 (the checkpoint's run: 0.05)" in lines[0]
    assert "--precision fp32 (the checkpoint's run: mixed)" in lines[0]
    assert "--batch-size" not in lines[0]          # given, but the same value

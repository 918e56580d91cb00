"""`graphopt run` says what is wrong in one line (never a traceback, never a numpy warning
first), refuses a checkpoint it did not write for this training graph, and keeps its
checkpoint folder safe from a second Ctrl-C, SIGTERM and a second run.

Test names carry the number of the promise they pin: 14 one error line, 15 a checkpoint of
another graph is refused, 16 every checkpoint field is validated, 17 a second Ctrl-C, 18
SIGTERM, 19 one run per checkpoint folder.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from support.cli_runs import assert_one_error_line, cli
from support.training_runs import edited_checkpoint

from graphopt.errors import GraphoptError
from graphopt.trainer import RunOptions, run
from graphopt.trainer import checkpoint as ckpt

from .killpoints import CLI
from .make_hostile_corpus import external_constant_scale

HERE = os.path.dirname(os.path.abspath(__file__))
MLP = os.path.join(HERE, os.pardir, "fixtures", "mlp.onnx")
TRAIN = ["--loss", "cross_entropy", "--batch-size", "4", "--device", "cpu", "-q"]


@pytest.fixture(scope="module")
def mlp_data(tmp_path_factory) -> str:
    rng = np.random.default_rng(1)
    path = tmp_path_factory.mktemp("data") / "data.npz"
    np.savez(path, x=rng.standard_normal((42, 64)).astype(np.float32),
             labels=rng.integers(0, 10, 42).astype(np.int64))
    return str(path)


def mlp_options(data: str, **overrides) -> RunOptions:
    base = dict(model=MLP, data=data, loss="cross_entropy", batch_size=4, optimizer="adamw",
                lr=0.01, seed=5, device="cpu", quiet=True, steps=3)
    return RunOptions(**{**base, **overrides})


def tiny_model(path: str, *, activation: str = "Relu", nodes=None, functions=(),
               output_type=TensorProto.FLOAT) -> str:
    """y = sum(activation(x @ W)) with a trainable W [4, 4]."""
    nodes = nodes or [helper.make_node("MatMul", ["x", "W"], ["h"]),
                      helper.make_node(activation, ["h"], ["a"]),
                      helper.make_node("ReduceSum", ["a"], ["y"], keepdims=0)]
    opsets = [helper.make_opsetid("", 17)] + [helper.make_opsetid(f.domain, 1)
                                              for f in functions]
    graph = helper.make_graph(
        nodes, "tiny", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", output_type, [])],
        initializer=[numpy_helper.from_array(
            np.random.default_rng(0).standard_normal((4, 4)).astype(np.float32), "W")])
    model = helper.make_model(graph, opset_imports=opsets, functions=list(functions))
    model.ir_version = 8
    with open(path, "wb") as f:
        f.write(model.SerializeToString())
    return path


@pytest.fixture(scope="module")
def tiny_data(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny") / "x.npz"
    np.savez(path, x=np.random.default_rng(2).standard_normal((8, 4)).astype(np.float32))
    return str(path)


# -- item 14: one clear line, never a traceback --------------------------------------------
def _external_weight_model(folder: str, location: str) -> str:
    model = onnx.load(tiny_model(os.path.join(folder, "plain.onnx")))
    weight = model.graph.initializer[0]
    weight.ClearField("raw_data")
    weight.ClearField("float_data")
    weight.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", "0"), ("length", "64")):
        entry = weight.external_data.add()
        entry.key, entry.value = key, value
    path = os.path.join(folder, "model.onnx")
    with open(path, "wb") as f:
        f.write(model.SerializeToString())
    return path


def test_item14_nul_byte_in_an_external_data_location_is_one_line(tmp_path, tiny_data):
    model = _external_weight_model(str(tmp_path), "w\0.bin")
    (tmp_path / "w.bin").write_bytes(bytes(64))
    code, _, stderr = cli("optimize", model, "-o", tmp_path / "out.onnx")
    assert_one_error_line(code, stderr, "external data location 'w\\x00.bin'")
    code, _, stderr = cli("run", model, "--data", tiny_data, "--loss", "output", "--steps", 1,
                          "--batch-size", 4, "--device", "cpu", "-q")
    assert_one_error_line(code, stderr, "external data location 'w\\x00.bin'")
    assert not (tmp_path / "out.onnx").exists()


def test_item14_damaged_compressed_data_is_one_line(tmp_path):
    rng = np.random.default_rng(1)
    path = tmp_path / "data.npz"
    np.savez_compressed(path, x=rng.integers(0, 3, (42, 64)).astype(np.float32),
                        labels=rng.integers(0, 10, 42).astype(np.int64))
    damaged = bytearray(path.read_bytes())
    for offset in range(200, 300):   # inside the deflate stream of 'x': zlib.error on read
        damaged[offset] ^= 0x55
    path.write_bytes(bytes(damaged))
    code, _, stderr = cli("run", MLP, "--data", path, "--steps", 1, *TRAIN)
    assert_one_error_line(code, stderr, f"--data {path}: not a readable .npz file")


@pytest.mark.parametrize("seed", [-1, 2**32, 2**70])
def test_item14_seed_out_of_range_is_one_line(mlp_data, seed):
    code, _, stderr = cli("run", MLP, "--data", mlp_data, "--steps", 1, "--seed", seed, *TRAIN)
    assert_one_error_line(code, stderr, "--seed")
    with pytest.raises(GraphoptError, match="--seed must be an integer from 0 to 4294967295"):
        run(mlp_options(mlp_data, seed=seed))


def test_item14_onnx_validation_error_while_reading_external_data_is_one_line(
        tmp_path, tiny_data, monkeypatch):
    """A local function's Constant keeps its value in external data at 'w.bin'. The load's
    check (onnx.checker) resolves it against the working directory, where a w.bin exists;
    reading the weights resolves it in the model's folder, where w.bin is a symlink: onnx
    raises its ValidationError there."""
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "real.bin").write_bytes(np.ones(16, np.float32).tobytes())
    os.symlink("real.bin", folder / "w.bin")
    scale = external_constant_scale("w.bin")
    model = tiny_model(str(folder / "model.onnx"), functions=[scale], nodes=[
        helper.make_node("MatMul", ["x", "W"], ["h"]),
        helper.make_node("Scale", ["h"], ["s"], domain="local"),
        helper.make_node("ReduceSum", ["s"], ["y"], keepdims=0)])
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (cwd / "w.bin").write_bytes(np.ones(16, np.float32).tobytes())
    monkeypatch.chdir(cwd)
    code, _, stderr = cli("run", model, "--data", tiny_data, "--loss", "output", "--steps", 1,
                          "--batch-size", 4, "--device", "cpu", "-q")
    assert_one_error_line(code, stderr, model)


def test_item14_unsupported_ops_in_run_are_one_line(tmp_path, tiny_data):
    # Det reads only the data (a batch of 4 rows of 4 is square): no gradient needed, but the
    # executor has no kernel for it
    model = tiny_model(str(tmp_path / "det.onnx"), nodes=[
        helper.make_node("MatMul", ["x", "W"], ["h"]),
        helper.make_node("Det", ["x"], ["d"], name="running_total"),
        helper.make_node("Mul", ["h", "d"], ["p"]),
        helper.make_node("ReduceSum", ["p"], ["y"], keepdims=0)])
    code, _, stderr = cli("run", model, "--data", tiny_data, "--loss", "output", "--steps", 1,
                          "--batch-size", 4, "--device", "cpu", "-q")
    assert_one_error_line(code, stderr, "does not support", "'running_total'", "Det")


def test_item14_a_loss_output_without_a_float_type_is_one_line(tmp_path, tiny_data):
    model = tiny_model(str(tmp_path / "int_loss.onnx"), output_type=TensorProto.INT64)
    code, _, stderr = cli("run", model, "--data", tiny_data, "--loss", "output", "--steps", 1,
                          "--batch-size", 4, "--device", "cpu", "-q")
    assert_one_error_line(code, stderr, "float")


@pytest.mark.parametrize("option,value,expected", [
    ("--lr", "inf", "--lr must be a finite number > 0"),
    ("--lr", "nan", "--lr must be a finite number > 0"),
    ("--weight-decay", "inf", "--weight-decay must be a finite number >= 0"),
    ("--loss-scale", "static:inf", "bad --loss-scale 'static:inf'"),
    ("--loss-scale", "static:1e39", "bad --loss-scale 'static:1e39'"),   # inf in float32
    # every step skipped and the scale stays inf when halved: exit 0, untrained model
    ("--loss-scale", "dynamic:inf", "bad --loss-scale 'dynamic:inf'"),
])
def test_item14_non_finite_settings_are_refused_without_numpy_warnings(
        mlp_data, option, value, expected):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code, _, stderr = cli("run", MLP, "--data", mlp_data, "--steps", 2, option, value,
                              *TRAIN)
    assert_one_error_line(code, stderr, expected)
    assert not [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


def test_item14_a_huge_finite_lr_stops_in_one_line_without_numpy_warnings(mlp_data):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code, _, stderr = cli("run", MLP, "--data", mlp_data, "--steps", 3, "--lr", "1e308",
                              *TRAIN)
    assert_one_error_line(code, stderr, "step 2: loss is nan")
    assert not [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]


# -- checkpoints edited by hand (items 14 and 16) -------------------------------------------
@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory, mlp_data) -> str:
    folder = str(tmp_path_factory.mktemp("good") / "ckpt")
    run(mlp_options(mlp_data, checkpoint=folder))
    return folder


def _set(*path_and_value):
    *path, value = path_and_value

    def edit(meta):
        for key in path[:-1]:
            meta = meta[key]
        meta[path[-1]] = value
    return edit


def _drop(*path):
    def edit(meta):
        for key in path[:-1]:
            meta = meta[key]
        del meta[path[-1]]
    return edit


# the six kinds of edit that made `--resume` print a traceback
TRACEBACK_EDITS = {
    "negative step": (_set("step", -3), None),
    "optimizer steps not a number": (_set("optimizer", "steps", "x"), None),
    "negative optimizer steps": (_set("optimizer", "steps", -1), None),
    "optimizer steps missing": (_drop("optimizer", "steps"), None),
    "loss scale not a number": (_set("scaler", "scale", "abc"), None),
    "skipped count missing": (_drop("scaler", "skipped"), None),
    "history not a list": (_set("history", "abc"), None),
    "history record not an object": (_set("history", [1, 2, 3]), None),
    "history loss not a number": (lambda m: m["history"][0].update(loss="x"), None),
    "optimizer array name without a slot": (
        None, lambda a: a.update({"opt/nokey": np.zeros(3, np.float32)})),
    "optimizer array of another shape": (
        None, lambda a: a.update({"opt/fc1.weight/exp_avg": np.zeros(3, np.float32)})),
}


@pytest.mark.parametrize("edit", list(TRACEBACK_EDITS))
def test_item14_edited_checkpoint_metadata_is_one_line(tmp_path, good_checkpoint, mlp_data,
                                                       edit):
    folder = edited_checkpoint(good_checkpoint, str(tmp_path / "ckpt"), *TRACEBACK_EDITS[edit])
    code, _, stderr = cli("run", MLP, "--data", mlp_data, "--steps", 6, "--seed", 5, "--lr",
                          0.01, "--checkpoint", folder, "--resume", *TRAIN)
    assert_one_error_line(code, stderr, "checkpoint")


# edits that resumed silently, with numbers nobody's run produced
SILENT_EDITS = {
    "complex weights": (None, lambda a: a.update(
        {"param/fc1.weight": a["param/fc1.weight"].astype(np.complex64) + 1j})),
    "float64 weights": (None, lambda a: a.update(
        {"param/fc1.weight": a["param/fc1.weight"].astype(np.float64)})),
    "integer weights": (None, lambda a: a.update(
        {"param/fc1.weight": a["param/fc1.weight"].astype(np.int32)})),
    "complex optimizer state": (None, lambda a: a.update(
        {"opt/fc1.weight/exp_avg": a["opt/fc1.weight/exp_avg"] + 0j})),
    "optimizer state of a weight the model lacks": (None, lambda a: a.update(
        {"opt/ghost/exp_avg": np.zeros(3, np.float32)})),
    "optimizer slot missing": (None, lambda a: a.pop("opt/fc1.weight/exp_avg")),
    "negative skipped-step count": (_set("scaler", "skipped", -5), None),
    "negative loss scale": (_set("scaler", "scale", -2.0), None),
    "fractional step": (_set("step", 2.5), None),
    "step true": (_set("step", True), None),
    "step without its history": (_set("step", 1), None),
    "epoch that is not the step's": (_set("data", "epoch", 7), None),
    "history record of another step": (lambda m: m["history"][1].update(step=9), None),
    "skipped step without a reason": (lambda m: m["history"][2].update(applied=False), None),
    "history longer than its step": (lambda m: _append_skipped_record(m), None),
    "no BLAS threads": (_set("blas_threads", 0), None),
    "BLAS threads as text": (_set("blas_threads", "2"), None),
}


def _append_skipped_record(meta):
    """One more history record than steps, made consistent with every other count (a skipped
    step: no optimizer update, the scaler's skipped count raised), so only the history's
    length against the step gives it away."""
    history = meta["history"]
    per_epoch = meta["data"]["size"] // meta["data"]["batch_size"]
    index = len(history)
    history.append(dict(history[-1], step=index + 1, epoch=index // per_epoch, applied=False,
                        nonfinite="gradients", skipped=history[-1]["skipped"] + 1))
    meta["scaler"]["skipped"] += 1


@pytest.mark.parametrize("edit", list(SILENT_EDITS))
def test_item16_every_checkpoint_field_is_validated(tmp_path, good_checkpoint, mlp_data, edit):
    folder = edited_checkpoint(good_checkpoint, str(tmp_path / "ckpt"), *SILENT_EDITS[edit])
    with pytest.raises(GraphoptError, match="checkpoint"):
        run(mlp_options(mlp_data, steps=6, checkpoint=folder, resume=True))
    # and what save() writes still loads: the validation is not stricter than the writer
    state = ckpt.load(good_checkpoint)
    assert state.step == 3 and state.scaler["skipped"] == 0


def test_item16_checkpoints_with_skipped_steps_still_load(tmp_path, mlp_data):
    """The counts the validation ties together (history, skipped steps, optimizer updates)
    hold for a run whose dynamic loss scale skips steps, in fp16 master weights too."""
    folder = str(tmp_path / "ckpt")
    run(mlp_options(mlp_data, steps=4, precision="fp16", loss_scale="dynamic:1e38:2",
                    checkpoint=folder))
    state = ckpt.load(folder)
    assert state.scaler["skipped"] > 0 and state.optimizer["steps"] == 4 - state.scaler["skipped"]
    resumed = run(mlp_options(mlp_data, steps=6, precision="fp16", loss_scale="dynamic:1e38:2",
                              checkpoint=folder, resume=True))
    assert resumed.result.steps_done == 6


def test_item16_a_copied_checkpoint_folder_still_resumes(tmp_path, good_checkpoint, mlp_data):
    folder = str(tmp_path / "copy")
    shutil.copytree(good_checkpoint, folder)
    outcome = run(mlp_options(mlp_data, steps=4, checkpoint=folder, resume=True))
    assert outcome.result.steps_done == 4


# -- item 15: a checkpoint resumes only in the training graph that wrote it -----------------
def _tiny_options(model: str, data: str, **overrides) -> RunOptions:
    base = dict(model=model, data=data, loss="output", batch_size=4, lr=0.01, seed=1,
                device="cpu", quiet=True, steps=2)
    return RunOptions(**{**base, **overrides})


def test_item15_a_checkpoint_of_another_graph_is_refused_unless_forced(tmp_path, tiny_data):
    relu = tiny_model(str(tmp_path / "relu.onnx"), activation="Relu")
    tanh = tiny_model(str(tmp_path / "tanh.onnx"), activation="Tanh")   # same W: name, shape
    folder = str(tmp_path / "ckpt")
    run(_tiny_options(relu, tiny_data, checkpoint=folder))
    code, _, stderr = cli("run", tanh, "--data", tiny_data, "--loss", "output", "--steps", 4,
                          "--batch-size", 4, "--lr", 0.01, "--seed", 1, "--device", "cpu",
                          "--checkpoint", folder, "--resume", "-q")
    assert_one_error_line(code, stderr, "was written for another training graph",
                          "--allow-changed-graph")
    assert ckpt.load(folder).step == 2   # left as it was
    # fine-tuning on purpose: the weights continue in the changed graph
    forced = run(_tiny_options(tanh, tiny_data, steps=4, checkpoint=folder, resume=True,
                               allow_changed_graph=True))
    assert forced.result.steps_done == 4 and len(forced.result.history) == 4
    # and the checkpoint now belongs to the Tanh graph
    again = run(_tiny_options(tanh, tiny_data, steps=5, checkpoint=folder, resume=True))
    assert again.result.steps_done == 5


def test_item15_the_same_graph_resumes_from_its_trained_model_and_at_another_level(
        tmp_path, mlp_data):
    folder = str(tmp_path / "ckpt")
    trained = str(tmp_path / "trained.onnx")
    run(mlp_options(mlp_data, checkpoint=folder, output=trained))
    straight = run(mlp_options(mlp_data, steps=5))
    # the model written by -o holds other weight values, the same graph: it resumes
    resumed = run(mlp_options(mlp_data, model=trained, steps=5, checkpoint=folder,
                              resume=True))
    for name, value in straight.result.params.items():
        np.testing.assert_array_equal(resumed.result.params[name], value)
    # rewrites keep the meaning: another --level is the same training graph
    run(mlp_options(mlp_data, steps=6, level=1, checkpoint=folder, resume=True))


def test_item15_a_checkpoint_without_a_fingerprint_needs_the_flag(tmp_path, good_checkpoint,
                                                                   mlp_data):
    folder = edited_checkpoint(good_checkpoint, str(tmp_path / "old"), _drop("graph"))
    with pytest.raises(GraphoptError, match="does not record which training graph"):
        run(mlp_options(mlp_data, steps=4, checkpoint=folder, resume=True))
    outcome = run(mlp_options(mlp_data, steps=4, checkpoint=folder, resume=True,
                              allow_changed_graph=True))
    assert outcome.result.steps_done == 4
    assert ckpt.load(folder).graph is not None


def test_item15_allow_changed_graph_needs_resume(mlp_data):
    code, _, stderr = cli("run", MLP, "--data", mlp_data, "--steps", 1,
                          "--allow-changed-graph", *TRAIN)
    assert_one_error_line(code, stderr, "--allow-changed-graph applies only with --resume")


# -- items 17 and 18: a second Ctrl-C, SIGTERM ------------------------------------------------
def test_item17_a_second_ctrl_c_names_the_checkpoint_this_run_wrote(tmp_path, mlp_data,
                                                                     monkeypatch):
    from graphopt.trainer import loop

    real_step = loop.Trainer.train_step

    def two_ctrl_c_at_step_7(self):   # the second arrives while step 7 is still running
        record = real_step(self)
        if self.step == 7:
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGINT)
        return record

    monkeypatch.setattr(loop.Trainer, "train_step", two_ctrl_c_at_step_7)
    folder = tmp_path / "ckpt"
    code, stdout, stderr = cli("run", MLP, "--data", mlp_data, "--steps", 20, "--checkpoint",
                               folder, "--checkpoint-every", 5, *TRAIN)
    assert code == 130 and stdout == "", (code, stdout, stderr)
    where = ckpt.path_in(str(folder))
    assert stderr.strip() == (f"graphopt: interrupted; the checkpoint of step 5 is {where} "
                              f"(continue with --checkpoint {folder} --resume)")
    assert ckpt.load(str(folder)).step == 5


@pytest.mark.skipif(os.name != "posix", reason="needs POSIX signals")
def test_item18_sigterm_checkpoints_and_exits_143(tmp_path, mlp_data):
    folder, log = tmp_path / "ckpt", tmp_path / "log.csv"
    args = [*CLI, "run", MLP, "--data", mlp_data, "--steps", "100000", "--checkpoint",
            str(folder), "--checkpoint-every", "50", "--log", str(log), "--seed", "5",
            *TRAIN]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline and \
            (not log.exists() or log.read_text().count("\n") < 8):
        time.sleep(0.005)
    proc.send_signal(signal.SIGTERM)   # between checkpoints: step 8 or a little later
    stdout, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 143, (proc.returncode, stderr[-500:])
    assert stderr == ""
    lines = stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("terminated (SIGTERM) after step "), stdout
    step = int(lines[0].split("after step ")[1].split(";")[0])
    where = ckpt.path_in(str(folder))
    assert lines[0] == (f"terminated (SIGTERM) after step {step}; checkpoint {where}; continue "
                        f"with --checkpoint {folder} --resume")
    assert 8 <= step < 50 and ckpt.load(str(folder)).step == step
    assert sorted(os.listdir(folder)) == [ckpt.FILENAME]
    # the final checkpoint is the uninterrupted run's state at that step
    straight = run(mlp_options(mlp_data, steps=step, lr=1e-3))   # the CLI default
    state = ckpt.load(str(folder))
    for name, value in straight.result.params.items():
        np.testing.assert_array_equal(state.params[name], value)


@pytest.mark.skipif(os.name != "posix", reason="needs POSIX signals")
def test_item18_sigterm_outside_training_is_one_line_and_exit_143(tmp_path):
    model = tiny_model(str(tmp_path / "m.onnx"))
    script = ("import os, signal\n"
              "from graphopt import api\n"
              "def optimize_file(*args, **kwargs):\n"
              "    os.kill(os.getpid(), signal.SIGTERM)\n"
              "    raise AssertionError('SIGTERM was ignored')\n"
              "api.optimize_file = optimize_file\n"
              "from graphopt.cli import main\n"
              f"main(['optimize', {model!r}, '-o', {str(tmp_path / 'o.onnx')!r}])\n")
    done = subprocess.run([sys.executable, "-P", "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 143, (done.returncode, done.stderr[-500:])
    assert done.stderr == "graphopt: terminated; nothing was written\n"


# -- item 19: one run per checkpoint folder -------------------------------------------------
def _start_long_run(folder, log, mlp_data) -> subprocess.Popen:
    args = [*CLI, "run", MLP, "--data", mlp_data, "--steps", "100000", "--checkpoint",
            str(folder), "--checkpoint-every", "4", "--log", str(log), "--seed", "5", *TRAIN]
    proc = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while proc.poll() is None and time.monotonic() < deadline and \
            (not log.exists() or log.read_text().count("\n") < 6):
        time.sleep(0.005)
    assert proc.poll() is None, proc.communicate()
    return proc


@pytest.mark.skipif(os.name != "posix", reason="needs POSIX signals")
def test_item19_a_second_run_on_the_same_checkpoint_folder_is_refused(tmp_path, mlp_data):
    folder = tmp_path / "ckpt"
    first = _start_long_run(folder, tmp_path / "log.csv", mlp_data)
    try:
        for resume in ([], ["--resume"]):
            code, _, stderr = cli("run", MLP, "--data", mlp_data, "--steps", 3, "--checkpoint",
                                  folder, *resume, *TRAIN)
            assert_one_error_line(code, stderr, f"--checkpoint {folder} is in use by another "
                                  f"graphopt run (pid {first.pid} on ")
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=120)
    assert first.returncode == 143
    step = ckpt.load(str(folder)).step
    # the first run's checkpoint is its own, and the folder is free once it is gone
    assert sorted(os.listdir(folder)) == [ckpt.FILENAME]
    outcome = run(mlp_options(mlp_data, lr=1e-3, steps=step + 2, checkpoint=str(folder),
                              resume=True))
    assert outcome.result.steps_done == step + 2
    assert sorted(os.listdir(folder)) == [ckpt.FILENAME]


@pytest.mark.skipif(os.name != "posix", reason="needs POSIX signals")
def test_item19_the_lock_of_a_killed_run_is_taken_over(tmp_path, mlp_data):
    folder = tmp_path / "ckpt"
    first = _start_long_run(folder, tmp_path / "log.csv", mlp_data)
    first.kill()
    first.communicate(timeout=120)
    assert ckpt.LOCK_NAME in os.listdir(folder)   # SIGKILL: nothing could remove it
    step = ckpt.load(str(folder)).step
    outcome = run(mlp_options(mlp_data, lr=1e-3, steps=step + 2, checkpoint=str(folder),
                              resume=True))
    assert outcome.result.steps_done == step + 2
    assert ckpt.LOCK_NAME not in os.listdir(folder)


def test_item19_without_flock_the_owner_pid_and_host_decide(tmp_path, monkeypatch):
    """Some network file systems have no flock: the lock file's owner decides there."""
    monkeypatch.setattr(ckpt, "_flock", lambda fd: None)
    folder = str(tmp_path / "ckpt")
    os.makedirs(folder)
    lock_file = os.path.join(folder, ckpt.LOCK_NAME)
    dead = subprocess.Popen([sys.executable, "-P", "-c", "pass"])
    dead.wait()
    here = ckpt.socket.gethostname()
    for owner, refused in [({"pid": dead.pid, "host": here}, False),     # stale: taken over
                           ({"pid": os.getppid(), "host": here}, True),   # alive here
                           ({"pid": 12345, "host": here + "-other"}, True),
                           ({}, False)]:
        with open(lock_file, "w") as f:
            json.dump(owner, f)
        if refused:
            with pytest.raises(GraphoptError, match="is in use by another graphopt run"):
                ckpt.FolderLock.acquire(folder)
            continue
        lock = ckpt.FolderLock.acquire(folder)
        with open(lock_file) as f:
            assert json.load(f)["pid"] == os.getpid()
        lock.release()
        assert not os.path.exists(lock_file)


def test_item19_a_failed_run_leaves_no_lock_and_no_new_folder(tmp_path, mlp_data):
    folder = tmp_path / "new"
    code, _, stderr = cli("run", MLP, "--data", mlp_data, "--steps", 1, "--lr", "-1",
                          "--checkpoint", folder, *TRAIN)
    assert_one_error_line(code, stderr, "--lr")
    assert not folder.exists()

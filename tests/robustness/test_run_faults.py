"""`graphopt run` under faults: killed while training and checkpointing, a disk that
fills up during a checkpoint save, and NaN/Inf in the loss or the gradients.

- SIGKILL at random steps and inside checkpoint writes (with --checkpoint-every 1), then
  --resume: the checkpoint is never partial or corrupt, always equals the uninterrupted
  run's state at its step, and the resumed run ends on bit-identical weights
  (tests/robustness/killpoints.py; GRAPHOPT_RUN_KILL_POINTS sets how many);
- load() refuses a truncated or damaged checkpoint in one line;
- ENOSPC while saving: one 'graphopt: error:' line, exit 1, the previous checkpoint intact;
- a Log fed a negative value at step 7: without loss scaling the run stops (exit 1) naming
  the step and the node, and the checkpoint of step 6 is left as it was (in a data-parallel
  run too, on every rank alike); with dynamic loss scaling the steps are skipped, counted,
  reported once, and training finishes.
"""
from __future__ import annotations

import errno
import io
import os
import random
import subprocess

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper, numpy_helper
from support.mpi import MPIEXEC, needs_mpi

from graphopt.cli import main
from graphopt.errors import GraphoptError
from graphopt.trainer import RunOptions, run
from graphopt.trainer import checkpoint as ckpt
from graphopt.trainer.data import Batches
from graphopt.trainer.loop import NonFiniteError

from .killpoints import CLI, RunKillRig, run_run_kill_points

MLP = os.path.join(os.path.dirname(__file__), os.pardir, "fixtures", "mlp.onnx")
BAD_STEP = 7   # 1-based: the step whose batch holds the negative value


# -- fixtures --------------------------------------------------------------------------------
def log_model(path: str, op: str = "Log") -> str:
    """loss = mean(-Log(x * s + b)) with trainable s, b; the Log is node 'loss/log'."""
    nodes = [helper.make_node("Mul", ["x", "s"], ["xs"], name="affine/mul"),
             helper.make_node("Add", ["xs", "b"], ["z"], name="affine/add"),
             helper.make_node(op, ["z"], ["logz"], name="loss/log"),
             helper.make_node("Neg", ["logz"], ["nll"], name="loss/neg"),
             helper.make_node("ReduceMean", ["nll"], ["loss"], name="loss/mean", keepdims=0)]
    graph = helper.make_graph(
        nodes, "log_model", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        initializer=[numpy_helper.from_array(np.ones(4, np.float32), "s"),
                     numpy_helper.from_array(np.full(4, 0.1 if op == "Log" else 0.0,
                                                     np.float32), "b")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, path)
    return path


def fault_data(path: str, value: float, seed: int = 3) -> str:
    """40 samples in [1, 2); one sample of the batch of BAD_STEP gets ``value``."""
    x = np.random.default_rng(0).uniform(1, 2, (40, 4)).astype(np.float32)
    rows = Batches({"x": x}, ["x"], 4, seed).order(0)[(BAD_STEP - 1) * 4:BAD_STEP * 4]
    x[rows[1], 2] = value
    np.savez(path, x=x)
    return path


def fault_options(tmp_path, value=-3.0, op="Log", **overrides) -> RunOptions:
    base = dict(model=log_model(str(tmp_path / f"{op}.onnx"), op),
                data=fault_data(str(tmp_path / "fault.npz"), value), loss="loss", steps=15,
                batch_size=4, optimizer="adamw", lr=0.01, seed=3, device="cpu", quiet=True)
    return RunOptions(**{**base, **overrides})


def cli(*args):
    result = CliRunner().invoke(main, ["run", *map(str, args)])
    return result.exit_code, result.stdout, result.stderr


# -- killed runs -----------------------------------------------------------------------------
@pytest.mark.skipif(os.name != "posix", reason="needs POSIX signals")
def test_sigkill_at_random_points_never_corrupts_and_resume_matches(tmp_path):
    count = int(os.environ.get("GRAPHOPT_RUN_KILL_POINTS", 6))
    results, chains, _ = run_run_kill_points(str(tmp_path), count, seed=3, chain=3)
    problems = [f"{r.signal} {r.how} ({r.moment}): {p}" for r in results for p in r.problems]
    problems += [p for c in chains for p in c.problems]
    assert not problems, "\n".join(problems)
    assert {r.how for r in results} >= {"at step", "inside write", "before rename"}
    assert all(c.final_equal and not c.leftovers_after_save for c in chains)
    assert sum(c.kills for c in chains) == count
    # SIGKILL inside a write leaves only a hidden temporary file, never the checkpoint name
    assert any(r.hidden_leftovers for r in results if r.how == "inside write")


def test_load_refuses_truncated_and_damaged_checkpoints(tmp_path):
    folder = str(tmp_path / "ckpt")
    rig = RunKillRig(str(tmp_path / "rig"), total_steps=3)
    run(rig.options(checkpoint=folder))
    good = ckpt.load(folder)
    path = ckpt.path_in(folder)
    with open(path, "rb") as f:
        data = f.read()
    rng = random.Random(0)
    cuts = sorted({0, 1, len(data) - 1, *rng.sample(range(len(data)), 60)})
    for cut in cuts:
        with open(path, "wb") as f:
            f.write(data[:cut])
        with pytest.raises(GraphoptError, match=r"checkpoint\.npz: not a readable checkpoint "
                                                r"\(truncated or damaged"):
            ckpt.load(folder)
    refused = 0
    for offset in rng.sample(range(len(data)), 120):   # a flipped bit: refused, or harmless
        damaged = bytearray(data)
        damaged[offset] ^= 1 << rng.randrange(8)
        with open(path, "wb") as f:
            f.write(bytes(damaged))
        try:
            state = ckpt.load(folder)
        except GraphoptError:
            refused += 1
            continue
        assert state.step == good.step and state.history == good.history
        for name, value in good.params.items():
            np.testing.assert_array_equal(state.params[name], value)
        for name, value in good.optimizer_arrays.items():
            np.testing.assert_array_equal(state.optimizer_arrays[name], value)
    assert refused > 60   # nearly every byte is data or checked header


def test_disk_full_during_a_checkpoint_save_keeps_the_previous_one(tmp_path, monkeypatch):
    folder = tmp_path / "ckpt"
    rig = RunKillRig(str(tmp_path / "rig"), total_steps=6)
    real = ckpt._write_archive
    calls, before = [], {}

    def full_disk(f, arrays):   # the second save: half the bytes, then ENOSPC
        calls.append(1)
        if len(calls) < 2:
            return real(f, arrays)
        with open(ckpt.path_in(str(folder)), "rb") as previous:
            before["bytes"] = previous.read()
        buffer = io.BytesIO()
        real(buffer, arrays)
        f.write(buffer.getvalue()[:len(buffer.getvalue()) // 2])
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(ckpt, "_write_archive", full_disk)
    code, _, stderr = cli(rig.model, "--data", rig.data, "--loss", "cross_entropy", "--steps", 6,
                          "--batch-size", 4, "--device", "cpu", "--checkpoint", folder,
                          "--checkpoint-every", 2, "-q")
    assert code == 1
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    assert lines[0].startswith("graphopt: error: could not save the checkpoint of step 4 in ")
    assert "No space left on device" in lines[0]
    assert f"the previous checkpoint {ckpt.path_in(str(folder))} (step 2) is intact" in lines[0]
    assert sorted(os.listdir(folder)) == [ckpt.FILENAME]   # the temporary file is gone
    with open(ckpt.path_in(str(folder)), "rb") as f:
        assert f.read() == before["bytes"]
    assert ckpt.load(str(folder)).step == 2


# -- NaN / Inf ------------------------------------------------------------------------------
def test_nan_loss_without_loss_scaling_stops_and_names_the_node(tmp_path):
    folder = tmp_path / "ckpt"
    opts = fault_options(tmp_path)
    code, _, stderr = cli(opts.model, "--data", opts.data, "--loss", "loss", "--steps", 15,
                          "--batch-size", 4, "--lr", 0.01, "--seed", 3, "--device", "cpu",
                          "--checkpoint", folder, "--checkpoint-every", 2, "-q")
    assert code == 1
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in stderr, stderr
    message = lines[0]
    assert message.startswith(f"graphopt: error: step {BAD_STEP}: loss is nan; first "
                              "non-finite value (nan) produced by Log node 'loss/log' (inputs "
                              "finite); training stopped")
    where = ckpt.path_in(str(folder))
    assert f"the last good checkpoint {where} (step 6) was left as it was" in message
    # the checkpoint is the good state of step 6: the same as a run that stops there
    state = ckpt.load(str(folder))
    assert state.step == 6 and len(state.history) == 6
    good = run(fault_options(tmp_path, steps=6))
    for name, value in good.result.params.items():
        np.testing.assert_array_equal(state.params[name], value)
    assert sorted(os.listdir(folder)) == [ckpt.FILENAME]


@pytest.mark.parametrize("value,op,expected", [
    (np.nan, "Log", "Mul node 'affine/mul' (input 'x' was already nan, from the data)"),
    # sqrt(0) is finite, its gradient is not: a finite loss with a NaN gradient
    (0.0, "Sqrt", "gradient of 's' holds nan (loss "),
])
def test_the_first_non_finite_node_and_its_inputs_are_named(tmp_path, value, op, expected):
    with pytest.raises(NonFiniteError) as info:   # b frozen at 0: x = 0 gives sqrt(0)
        run(fault_options(tmp_path, value=value, op=op, freeze=("b",)))
    message = str(info.value)
    assert message.startswith(f"step {BAD_STEP}: ") and expected in message
    assert "first non-finite value" in message and "produced by" in message
    assert "nothing was saved (--checkpoint DIR would keep the last good state)" in message
    assert message.endswith("; --loss-scale dynamic would skip such steps instead")


def test_nan_loss_with_dynamic_scaling_is_skipped_counted_and_reported_once(tmp_path):
    lines: list[str] = []
    outcome = run(fault_options(tmp_path, steps=25, quiet=False, loss_scale="dynamic:1024:1000"),
                  echo=lines.append, progress_stream=io.StringIO())
    result = outcome.result
    skipped = [r["step"] for r in result.history if not r["applied"]]
    assert skipped == [BAD_STEP, 12] and result.skipped == 2   # once in each epoch
    assert result.nonfinite == {"loss": 2}
    assert all(r.get("nonfinite") == "loss" for r in result.history if not r["applied"])
    reports = [line for line in lines if "non-finite value" in line]
    assert reports == [f"step {BAD_STEP}: loss is nan; first non-finite value (nan) produced by "
                       "Log node 'loss/log' (inputs finite); step skipped, loss scale 1024 -> "
                       "512 (later non-finite loss steps are skipped and counted, not reported)"]
    assert any("skipped steps 2 (non-finite loss 2)" in line for line in lines)
    assert result.steps_done == 25
    assert all(np.isfinite(v).all() for v in result.params.values())


def test_skipped_steps_are_counted_across_a_resume(tmp_path):
    folder = str(tmp_path / "ckpt")
    common = dict(loss_scale="dynamic:1024:1000", checkpoint=folder)
    run(fault_options(tmp_path, steps=10, **common))
    resumed = run(fault_options(tmp_path, steps=25, resume=True, **common))
    straight = run(fault_options(tmp_path, steps=25, loss_scale="dynamic:1024:1000"))
    assert resumed.result.nonfinite == straight.result.nonfinite == {"loss": 2}
    for name, value in straight.result.params.items():
        np.testing.assert_array_equal(resumed.result.params[name], value)


@needs_mpi
def test_distributed_ranks_agree_to_stop_at_the_faulty_step(tmp_path):
    """The NaN is in rank 0's share of the batch; both ranks stop after step 6's checkpoint,
    each on its own (exit 1, no abort), and rank 0 names the node."""
    folder = tmp_path / "ckpt"
    opts = fault_options(tmp_path)
    done = subprocess.run(
        [MPIEXEC, "-n", "2", *CLI, "run", opts.model, "--data", opts.data, "--loss", "loss",
         "--steps", "15", "--batch-size", "4", "--lr", "0.01", "--seed", "3", "--device",
         "cpu", "--distributed", "--checkpoint", str(folder), "--checkpoint-every", "2", "-q"],
        capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert "Traceback" not in done.stderr and len(lines) == 2, done.stderr
    rank0 = next(line for line in lines if "[rank" not in line)
    assert rank0.startswith(f"graphopt: error: step {BAD_STEP}: loss is nan; first non-finite "
                            "value (nan) produced by Log node 'loss/log' (inputs finite)")
    assert any(line.startswith(f"graphopt: error: [rank 1/2] step {BAD_STEP}: loss is nan")
               for line in lines)
    assert ckpt.load(str(folder)).step == 6


def test_disk_full_while_writing_the_step_log_is_one_line(tmp_path, monkeypatch):
    from graphopt.trainer import progress

    rig = RunKillRig(str(tmp_path / "rig"), total_steps=4)
    real = progress.StepLog.write
    writes = []

    def full(self, record):   # step 3's record is refused by the disk
        writes.append(record["step"])
        return real(self, record)

    def write(fd, data):
        if writes and writes[-1] == 3:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return os.write(fd, data)

    monkeypatch.setattr(progress.StepLog, "write", full)
    monkeypatch.setattr(progress, "_write", write)
    log = tmp_path / "log.csv"
    code, _, stderr = cli(rig.model, "--data", rig.data, "--loss", "cross_entropy", "--steps", 4,
                          "--batch-size", 4, "--device", "cpu", "--log", log, "-q")
    assert code == 1 and "Traceback" not in stderr
    assert stderr.strip() == (f"graphopt: error: --log {log}: cannot write step 3: No space "
                              "left on device; the log keeps its whole records")
    assert len(log.read_text().splitlines()) == 3   # the header and steps 1 and 2


def _float16_mask_model(path) -> str:
    """s = x @ w + mask, mask = [float32's minimum, 0, 0, 0] (an additive attention mask:
    -inf in float16, as intended); loss = sum(s - s): NaN where s is -inf, in float16."""
    mask = np.array([np.finfo(np.float32).min, 0, 0, 0], np.float32)
    w = np.eye(4, dtype=np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["xw"], name="project"),
         helper.make_node("Add", ["xw", "onnx::Add_9"], ["s"], name="mask/add"),
         helper.make_node("Sub", ["s", "s"], ["d"], name="fault/sub"),
         helper.make_node("ReduceSum", ["d"], ["loss"], keepdims=0, name="loss/sum")],
        "masked", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        [numpy_helper.from_array(w, "w"), numpy_helper.from_array(mask, "onnx::Add_9")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return str(path)


def test_a_float16_masks_intended_minus_inf_is_not_blamed_for_the_nan(tmp_path):
    """The mask's -inf appears first (the Add); the NaN the loss holds comes from the Sub:
    that is the node named."""
    data = tmp_path / "x.npz"
    np.savez(data, x=np.ones((4, 4), np.float32))
    with pytest.raises(NonFiniteError) as info:
        run(RunOptions(model=_float16_mask_model(tmp_path / "m.onnx"), data=str(data),
                       loss="loss", steps=1, batch_size=4, precision="fp16",
                       loss_scale="none", device="cpu", quiet=True))
    message = str(info.value)
    assert "loss is nan" in message
    assert "first non-finite value (nan) produced by Sub node 'fault/sub'" in message, message
    assert "mask/add" not in message


def test_a_minus_inf_from_constants_alone_is_said_to_be_one():
    from graphopt.executor import Session
    from graphopt.trainer.loop import locate_nonfinite

    minus_inf = numpy_helper.from_array(np.array([-np.inf, 0], np.float16), "mask")
    graph = helper.make_graph(
        [helper.make_node("Identity", ["mask"], ["m"], name="copy"),
         helper.make_node("Sub", ["m", "m"], ["d"], name="fault/sub"),
         helper.make_node("Add", ["d", "x"], ["y"], name="use")],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT16, [2])], [minus_inf])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    found = locate_nonfinite(Session(model, device="cpu"), {"x": np.zeros(2, np.float16)},
                             kind="nan")
    assert found.startswith("first non-finite value (nan) produced by Sub node 'fault/sub'")
    assert "input 'm' was already -inf, from constants alone" in found

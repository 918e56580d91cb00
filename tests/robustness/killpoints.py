"""Interrupting `graphopt optimize` (SIGKILL, SIGINT) at random moments, and what it leaves.

A big model (thousands of rewritable nodes and a large external weight, so that loading,
rewriting, validating and the streamed, fsynced save all take a while) is optimized again
and again into the SAME output folder, and each run is interrupted after a random delay.
After every interruption:

- the output path either does not exist or holds exactly the complete output (the same
  bytes as an uninterrupted run), with its external data file complete beside it;
- nothing else visible is in the output folder, except (after SIGKILL only) a complete
  ``<out>.<digest>.data`` file renamed into place just before the model file: it is named
  after its content and cannot be taken for the model (it is kept: graphopt deletes no file
  it did not create in the same run; a later save of the same content reuses it);
- hidden temporary files (``.<out>.*.tmp``) may remain only after SIGKILL (nothing can run
  on SIGKILL), until the next save to that folder removes them (their process is gone);
  after SIGINT there are none and the command says it was interrupted.

Used by tests/robustness/test_interrupts.py and tools/reliability_report.py.
"""
from __future__ import annotations

import hashlib
import os
import random
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

GRAPHOPT = os.path.join(os.path.dirname(sys.executable), "graphopt")
CLI = [GRAPHOPT] if os.path.exists(GRAPHOPT) else [sys.executable, "-P", "-m", "graphopt.cli"]


def build_big_model(folder: str, blocks: int = 1500, big_weight_mb: int = 48) -> str:
    """x -> blocks x [MatMul(h, Transpose(W_i)) * 0.5 + Softmax] -> MatMul(h, BIG) -> y."""
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(0)
    nodes, inits = [], []
    h = "x"
    for i in range(blocks):
        inits.append(numpy_helper.from_array(
            rng.standard_normal((8, 8)).astype(np.float32), f"W{i}"))
        nodes += [helper.make_node("Transpose", [f"W{i}"], [f"Wt{i}"], perm=[1, 0]),
                  helper.make_node("MatMul", [h, f"Wt{i}"], [f"m{i}"]),
                  helper.make_node("Mul", [f"m{i}", "half"], [f"s{i}"]),
                  helper.make_node("Softmax", [f"s{i}"], [f"h{i}"], axis=-1)]
        h = f"h{i}"
    cols = big_weight_mb * (1 << 20) // (8 * 4)
    inits.append(numpy_helper.from_array(np.ones((8, cols), np.float32), "BIG"))
    inits.append(numpy_helper.from_array(np.array(0.5, np.float32), "half"))
    nodes.append(helper.make_node("MatMul", [h, "BIG"], ["y"]))
    graph = helper.make_graph(nodes, "big", [helper.make_tensor_value_info(
        "x", TensorProto.FLOAT, [2, 8])], [helper.make_tensor_value_info(
            "y", TensorProto.FLOAT, [2, cols])], initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = os.path.join(folder, "big.onnx")
    onnx.save_model(model, path, save_as_external_data=True, all_tensors_to_one_file=True,
                    location="big.onnx.data", size_threshold=1 << 20)
    return path


@dataclass
class KillResult:
    signal: str
    delay: float
    returncode: int
    output_state: str  # "absent" or "complete"
    visible_leftovers: list[str] = field(default_factory=list)
    hidden_leftovers: list[str] = field(default_factory=list)
    stale_data_files: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    fresh: bool = False


class KillRig:
    def __init__(self, model: str, out_dir: str):
        self.model, self.out_dir = model, out_dir
        self.out = os.path.join(out_dir, "opt.onnx")
        os.makedirs(out_dir, exist_ok=True)
        self.reference: bytes | None = None
        # Run from the model's folder: from elsewhere, a model with external data fails the
        # final check (a known bug: the whole-model check resolves external data against
        # the working directory; see tests/ir/test_modelio.py).
        self.cwd = os.path.dirname(os.path.abspath(model))
        self.seconds = 0.0

    def _argv(self):
        return [*CLI, "optimize", self.model, "-o", self.out]

    def calibrate(self) -> float:
        """One complete run: the reference output and how long a run takes."""
        start = time.perf_counter()
        proc = subprocess.run(self._argv(), capture_output=True, text=True, timeout=600,
                              cwd=self.cwd)
        self.seconds = time.perf_counter() - start
        if proc.returncode != 0:
            raise RuntimeError(f"reference run failed: {proc.stderr}")
        with open(self.out, "rb") as f:
            self.reference = f.read()
        os.unlink(self.out)
        for name in os.listdir(self.out_dir):
            os.unlink(os.path.join(self.out_dir, name))
        return self.seconds

    def kill_once(self, sig: int, delay: float, fresh: bool = False) -> KillResult:
        """Interrupt one run; ``fresh``: start from an empty output folder (else the output
        of earlier runs is there and must survive intact)."""
        if fresh:
            for name in os.listdir(self.out_dir):
                if not name.startswith("."):
                    os.unlink(os.path.join(self.out_dir, name))
        existed = set(os.listdir(self.out_dir))
        proc = subprocess.Popen(self._argv(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, cwd=self.cwd)
        time.sleep(delay)
        if proc.poll() is None:
            proc.send_signal(sig)
        _, stderr = proc.communicate(timeout=600)
        name = "SIGKILL" if sig == signal.SIGKILL else "SIGINT"
        result = KillResult(name, delay, proc.returncode, "absent", fresh=fresh)
        listing = sorted(os.listdir(self.out_dir))
        data_name = None
        if os.path.exists(self.out):
            result.output_state = "complete"
            with open(self.out, "rb") as f:
                got = f.read()
            if got != self.reference:
                result.output_state = "CORRUPT"
                result.problems.append("the output path holds something else than the output")
            else:
                data_name = _data_file_name(got)
                data_path = os.path.join(self.out_dir, data_name) if data_name else None
                if data_path and not os.path.isfile(data_path):
                    result.problems.append(f"output present but its data {data_name} is not")
                elif data_path and not _data_matches(self.reference, self.out_dir):
                    result.problems.append(f"output present but {data_name} is incomplete")
        stem = os.path.basename(self.out)
        content_named = re.compile(rf"^{re.escape(stem)}\.[0-9a-f]+\.data$")
        for entry in listing:
            if entry in (stem, data_name) or entry in existed:
                continue
            if entry.startswith("."):
                result.hidden_leftovers.append(entry)
            elif content_named.match(entry):
                result.stale_data_files.append(entry)
            else:
                result.visible_leftovers.append(entry)
        if result.visible_leftovers:
            result.problems.append(f"visible leftovers {result.visible_leftovers}")
        if sig == signal.SIGINT:
            if result.hidden_leftovers:
                result.problems.append(f"temporary files left after SIGINT "
                                       f"{result.hidden_leftovers}")
            if result.stale_data_files and result.output_state == "absent":
                result.problems.append(f"data file without its model after SIGINT "
                                       f"{result.stale_data_files}")
            before_python_ran = "init_import_site" in stderr  # Python's own start-up
            if before_python_ran:
                result.notes.append("SIGINT while Python itself was starting: "
                                    "init_import_site failed")
            elif proc.returncode not in (0, 130, -signal.SIGINT):
                result.problems.append(
                    f"exit code {proc.returncode} after SIGINT: {stderr[-300:]}")
            if proc.returncode != 130 and "Traceback" in stderr:
                result.notes.append("SIGINT outside the command's handler (start-up or exit): "
                                    "KeyboardInterrupt traceback; "
                                    + stderr.strip().splitlines()[-1])
        for entry in result.stale_data_files:  # complete, content-named: must be a real copy
            if not _is_complete_data_file(self.reference, os.path.join(self.out_dir, entry)):
                result.problems.append(f"{entry} is not a complete data file")
        return result


def _data_file_name(model_bytes: bytes) -> str | None:
    """Where the model's external data lives (the first initializer's location)."""
    proto = onnx.ModelProto()
    proto.ParseFromString(model_bytes)
    for tensor in proto.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                return entry.value
    return None


def _data_matches(reference: bytes, folder: str) -> bool:
    name = _data_file_name(reference)
    return name is None or _is_complete_data_file(reference, os.path.join(folder, name))


def _is_complete_data_file(reference: bytes, path: str) -> bool:
    """Every external tensor of the reference output fits in this file (offset + length)."""
    proto = onnx.ModelProto()
    proto.ParseFromString(reference)
    size = os.path.getsize(path)
    for tensor in proto.graph.initializer:
        info = {e.key: e.value for e in tensor.external_data}
        if info and int(info.get("offset", 0)) + int(info.get("length", 0)) > size:
            return False
    return True


def run_kill_points(model: str, out_dir: str, count: int, seed: int = 0,
                    log=None) -> tuple[list[KillResult], float]:
    rig = KillRig(model, out_dir)
    seconds = rig.calibrate()
    rng = random.Random(seed)
    results = []
    for i in range(count):
        sig = signal.SIGKILL if i % 2 == 0 else signal.SIGINT
        delay = rng.uniform(0.02, 1.05) * seconds
        result = rig.kill_once(sig, delay, fresh=(i % 4) < 2)
        results.append(result)
        if log:
            log(result)
    return results, seconds


def hidden_files(out_dir: str) -> list[str]:
    return sorted(n for n in os.listdir(out_dir) if n.startswith("."))


def digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


# -- `graphopt run`: killed while training and checkpointing, then resumed -------------------
#
# A small MLP is trained with --checkpoint-every 1 (a checkpoint write every step) into one
# checkpoint folder, and the run is interrupted again and again: SIGKILL at a random step
# (from outside, when the per-step log reaches that step, plus a random fraction of a step),
# SIGKILL from inside a checkpoint write (after a random number of bytes of the temporary
# file, just before the rename, just after it), and SIGINT and SIGTERM at a random step
# (both: finish the step, checkpoint, exit 130 / 143, nothing left behind). Each next run
# resumes from whatever checkpoint is there (or starts over when there is none). After every
# interruption:
#
# - the folder holds checkpoint.npz (or nothing yet) and, after SIGKILL only, hidden
#   ``.checkpoint-*.npz.tmp`` files and the killed run's folder lock (which the next run
#   takes over): never a partial checkpoint under the real name;
# - checkpoint.npz loads, and holds exactly the state (weights, optimizer, loss scaler,
#   history) of the uninterrupted run at its step, which never goes backwards;
# and at the end of a chain of interruptions, a resumed run finishes with weights bit-for-bit
# equal to the uninterrupted run's, and the next successful save has removed the temporary
# files of the killed writers.

RUN_WRAPPER = r"""
import os, signal, sys
mode, nth, cut = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
from graphopt.trainer import checkpoint as ck
calls = {"write": 0, "replace": 0}
def die():
    os.kill(os.getpid(), signal.SIGKILL)
class Cut:
    def __init__(self, f):
        self.f, self.written = f, 0
    def __getattr__(self, name):
        return getattr(self.f, name)
    def write(self, data):
        n = self.f.write(data)
        self.written += memoryview(data).nbytes
        if self.written >= cut:
            self.f.flush()
            die()
        return n
real_write, real_replace = ck._write_archive, os.replace
def write_archive(f, arrays):
    calls["write"] += 1
    if mode == "write" and calls["write"] == nth:
        real_write(Cut(f), arrays)
        f.flush()
        die()
    real_write(f, arrays)
def replace(src, dst, *args, **kwargs):
    if not os.path.basename(str(src)).startswith(ck.TEMP_PREFIX):
        return real_replace(src, dst, *args, **kwargs)
    calls["replace"] += 1
    if mode == "before-rename" and calls["replace"] == nth:
        die()
    real_replace(src, dst, *args, **kwargs)
    if mode == "after-rename" and calls["replace"] == nth:
        die()
ck._write_archive, os.replace = write_archive, replace
from graphopt.cli import main
main(sys.argv[4:], prog_name="graphopt")
"""

RUN_SETTINGS = dict(loss="cross_entropy", batch_size=4, optimizer="adamw", lr=0.01, seed=5,
                    device="cpu")


@dataclass
class RunKillResult:
    signal: str
    how: str                      # "at step", "inside write", "before rename", "after rename"
    moment: str                   # in words
    returncode: int
    checkpoint_step: int | None   # the step of checkpoint.npz afterwards (None: none yet)
    hidden_leftovers: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    in_write: bool = False        # this run left its own temporary file: killed mid-save


@dataclass
class RunChainResult:
    kills: int
    final_equal: bool
    leftovers_after_save: list[str]
    problems: list[str] = field(default_factory=list)


def _state_digest(state) -> str:
    h = hashlib.sha256()
    for name, value in state.params.items():
        h.update(name.encode())
        h.update(np.ascontiguousarray(value, np.float32).tobytes())
    for name in sorted(state.optimizer_arrays):
        h.update(name.encode())
        h.update(np.ascontiguousarray(state.optimizer_arrays[name]).tobytes())
    h.update(repr(sorted(state.optimizer.items())).encode())
    h.update(repr(sorted(state.scaler.items())).encode())
    return h.hexdigest()


class RunKillRig:
    """Interrupt `graphopt run` over and over in one checkpoint folder (see above)."""

    def __init__(self, folder: str, total_steps: int = 60, model: str | None = None,
                 samples: int = 42, extra: dict | None = None):
        self.folder = folder
        os.makedirs(folder, exist_ok=True)
        here = os.path.dirname(os.path.abspath(__file__))
        self.model = model or os.path.join(here, os.pardir, "fixtures", "mlp.onnx")
        rng = np.random.default_rng(1)
        self.data = os.path.join(folder, "data.npz")
        np.savez(self.data, x=rng.standard_normal((samples, 64)).astype(np.float32),
                 labels=rng.integers(0, 10, samples).astype(np.int64))
        self.total = total_steps
        self.settings = {**RUN_SETTINGS, **(extra or {})}
        self.digests: dict[int, str] = {}
        self.losses: list[float] = []
        self.final: dict[str, np.ndarray] = {}
        self.step_seconds = 0.01
        self.chain = 0
        self.checkpoints = self.log = ""
        self.new_chain()

    def options(self, **overrides):
        from graphopt.trainer import RunOptions

        return RunOptions(model=self.model, data=self.data, steps=self.total, quiet=True,
                          **{**self.settings, **overrides})

    def argv(self, resume: bool) -> list[str]:
        args = ["run", self.model, "--data", self.data, "--steps", str(self.total),
                "--checkpoint", self.checkpoints, "--checkpoint-every", "1", "--log", self.log,
                "-q"]
        for key, value in self.settings.items():
            args += [f"--{key.replace('_', '-')}", str(value)]
        return args + (["--resume"] if resume else [])

    def reference(self) -> None:
        """The uninterrupted run, in-process: its state after every step, its final weights."""
        from graphopt.trainer import checkpoint as ckpt
        from graphopt.trainer import run

        folder = os.path.join(self.folder, "reference")
        seen: dict[int, str] = {}

        def after_step(step, _record):   # runs before step's own save: holds step - 1
            if step > 1:
                seen[step - 1] = _state_digest(ckpt.load(folder))

        start = time.perf_counter()
        outcome = run(self.options(checkpoint=folder, checkpoint_every=1),
                      after_step=after_step)
        self.step_seconds = (time.perf_counter() - start) / self.total
        final = ckpt.load(folder)
        seen[final.step] = _state_digest(final)
        self.digests, self.losses = seen, outcome.result.losses
        self.final = outcome.result.params

    def new_chain(self) -> None:
        self.chain += 1
        self.checkpoints = os.path.join(self.folder, f"ckpt{self.chain}")
        self.log = os.path.join(self.folder, f"log{self.chain}.csv")
        self.last_step = 0

    def current_step(self) -> int | None:
        from graphopt.trainer import checkpoint as ckpt

        if not os.path.exists(ckpt.path_in(self.checkpoints)):
            return None
        return ckpt.read_step(self.checkpoints)

    def _log_lines(self) -> int:
        try:
            with open(self.log, "rb") as f:
                return f.read().count(b"\n")
        except FileNotFoundError:
            return 0

    def kill_once(self, sig: int, how: str, rng: random.Random) -> RunKillResult:
        """One interrupted run. ``how``: "at step" (from outside, at a random step and
        moment), "inside write", "before rename", "after rename" (SIGKILL from inside the
        process, during a random checkpoint write of this run)."""
        from graphopt.trainer import checkpoint as ckpt

        start_step = self.current_step() or 0
        remaining = self.total - start_step
        resume = start_step > 0
        argv = self.argv(resume)
        n = rng.randint(1, max(1, min(remaining - 1, 12)))   # the n-th step/save of this run
        if how == "at step":
            command = [*CLI, *argv]
        else:
            mode = {"inside write": "write", "before rename": "before-rename",
                    "after rename": "after-rename"}[how]
            size = os.path.getsize(ckpt.path_in(self.checkpoints)) if resume else 50_000
            cut = rng.randint(1, size)
            command = [sys.executable, "-P", "-c", RUN_WRAPPER, mode, str(n), str(cut), *argv]
        before = self._log_lines()
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        moment = f"step {start_step + n}"
        if how == "at step":
            extra = rng.uniform(0, 1.5) * self.step_seconds
            deadline = time.monotonic() + 120
            while self._log_lines() < before + n + (0 if resume else 1) and \
                    proc.poll() is None and time.monotonic() < deadline:
                time.sleep(0.001)
            time.sleep(extra)
            moment += f" + {extra * 1000:.1f} ms"
            if proc.poll() is None:
                proc.send_signal(sig)
        elif how == "inside write":
            moment = f"save {n} of the run (step {start_step + n}), after {cut} bytes"
        else:
            moment = f"save {n} of the run (step {start_step + n}), {how}"
        try:
            _, stderr = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()
            _, stderr = proc.communicate()
        name = signal.Signals(sig).name
        result = RunKillResult(name, how, moment, proc.returncode, None)
        self._check(result, proc.pid, stderr, start_step)
        return result

    def _check(self, result: RunKillResult, pid: int, stderr: str, start_step: int) -> None:
        from graphopt.errors import GraphoptError
        from graphopt.trainer import checkpoint as ckpt

        code = result.returncode
        if code == 0:
            result.notes.append("the run finished before the signal")
        elif result.signal == "SIGKILL" and code != -signal.SIGKILL:
            result.problems.append(f"exit code {code} (expected SIGKILL): {stderr[-300:]}")
        elif result.signal == "SIGINT" and code != 130:
            result.problems.append(f"exit code {code} after SIGINT: {stderr[-300:]}")
        elif result.signal == "SIGTERM" and code != 143:
            result.problems.append(f"exit code {code} after SIGTERM: {stderr[-300:]}")
        if "Traceback" in stderr:
            result.problems.append(f"traceback: {stderr.strip().splitlines()[-1]}")
        listing = sorted(os.listdir(self.checkpoints)) if os.path.isdir(self.checkpoints) else []
        for entry in listing:
            if entry == ckpt.FILENAME:
                continue
            if entry.startswith(ckpt.TEMP_PREFIX) and entry.endswith(ckpt.TEMP_SUFFIX):
                result.hidden_leftovers.append(entry)
                result.in_write = result.in_write or f"-{pid}-" in entry
                if result.signal != "SIGKILL" and f"-{pid}-" in entry:
                    result.problems.append(f"temporary file left after {result.signal}: "
                                           f"{entry}")
            elif entry == ckpt.LOCK_NAME:   # the folder lock: free once its run is gone
                if result.signal != "SIGKILL":
                    result.problems.append(f"the folder lock was left after {result.signal}")
            else:
                result.problems.append(f"unexpected file in the checkpoint folder: {entry}")
        if ckpt.FILENAME not in listing:
            if start_step:
                result.problems.append("the checkpoint disappeared")
            return
        try:
            state = ckpt.load(self.checkpoints)
        except GraphoptError as exc:
            result.problems.append(f"CORRUPT checkpoint: {exc}")
            return
        result.checkpoint_step = state.step
        if state.step < start_step:
            result.problems.append(f"the checkpoint went back from step {start_step} to "
                                   f"{state.step}")
        if self.digests.get(state.step) != _state_digest(state):
            result.problems.append(f"the checkpoint of step {state.step} differs from the "
                                   "uninterrupted run's state at that step")
        if [r["loss"] for r in state.history] != self.losses[:state.step]:
            result.problems.append(f"the checkpoint's history of step {state.step} differs "
                                   "from the uninterrupted run's")

    def finish(self, kills: int) -> RunChainResult:
        """Resume in-process to the end; the weights must equal the uninterrupted run's."""
        from graphopt.trainer import checkpoint as ckpt
        from graphopt.trainer import run

        resume = self.current_step() is not None
        outcome = run(self.options(checkpoint=self.checkpoints, checkpoint_every=1,
                                   resume=resume, log=self.log))
        problems = []
        equal = list(outcome.result.params) == list(self.final) and all(
            np.array_equal(outcome.result.params[n], v) for n, v in self.final.items())
        if not equal:
            problems.append("the resumed run did not end on the uninterrupted run's weights")
        if outcome.result.losses != self.losses:
            problems.append("the resumed run's loss history differs")
        leftovers = [e for e in os.listdir(self.checkpoints) if e != ckpt.FILENAME]
        if leftovers:
            problems.append(f"files left after a successful save: {leftovers}")
        return RunChainResult(kills, equal, leftovers, problems)


RUN_KILL_KINDS = [(signal.SIGKILL, "at step"), (signal.SIGKILL, "inside write"),
                  (signal.SIGTERM, "at step"), (signal.SIGKILL, "before rename"),
                  (signal.SIGINT, "at step"), (signal.SIGKILL, "after rename")]


def run_run_kill_points(folder: str, count: int, seed: int = 0, chain: int = 6,
                        log=None) -> tuple[list[RunKillResult], list[RunChainResult], float]:
    """``count`` interruptions of `graphopt run`, in chains of ``chain`` in one checkpoint
    folder, each chain finished by a resumed run compared with the uninterrupted one.
    Returns (interruptions, chains, seconds per step of the reference run)."""
    rig = RunKillRig(folder)
    rig.reference()
    rng = random.Random(seed)
    results, chains = [], []
    in_chain = 0
    for i in range(count):
        sig, how = RUN_KILL_KINDS[i % len(RUN_KILL_KINDS)]
        result = rig.kill_once(sig, how, rng)
        results.append(result)
        in_chain += 1
        if log:
            log(result)
        if in_chain == chain or i == count - 1:
            chains.append(rig.finish(in_chain))
            rig.new_chain()
            in_chain = 0
    return results, chains, rig.step_seconds

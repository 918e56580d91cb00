"""Interrupting `graphopt optimize` (SIGKILL, SIGINT) at random moments, and what it leaves.

A big model (thousands of rewritable nodes and a large external weight, so that loading,
rewriting, validating and the streamed, fsynced save all take a while) is optimized again
and again into the SAME output folder, and each run is interrupted after a random delay.
After every interruption:

- the output path either does not exist or holds exactly the complete output (the same
  bytes as an uninterrupted run), with its external data file complete beside it;
- nothing else visible is in the output folder, except (after SIGKILL only) a complete
  ``<out>.<digest>.data`` file renamed into place just before the model file: it is named
  after its content, cannot be taken for the model, and the next successful save removes it;
- hidden temporary files (``.<out>.*.tmp``) may remain only after SIGKILL (nothing can run
  on SIGKILL); after SIGINT there are none and the command says it was interrupted.

Used by tests/robustness/test_interrupts.py and scripts/reliability_report.py.
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
CLI = [GRAPHOPT] if os.path.exists(GRAPHOPT) else [sys.executable, "-m", "graphopt.cli"]


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

    def _data_name(self, model_bytes: bytes) -> str | None:
        proto = onnx.ModelProto()
        proto.ParseFromString(model_bytes)
        for tensor in proto.graph.initializer:
            for entry in tensor.external_data:
                if entry.key == "location":
                    return entry.value
        return None

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
                data_name = self._data_name(got)
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
            if proc.returncode not in (0, 130, -signal.SIGINT):
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


def _expected_data_digest(reference: bytes) -> str | None:
    proto = onnx.ModelProto()
    proto.ParseFromString(reference)
    for tensor in proto.graph.initializer:
        for entry in tensor.external_data:
            if entry.key == "location":
                return entry.value
    return None


def _data_matches(reference: bytes, folder: str) -> bool:
    name = _expected_data_digest(reference)
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

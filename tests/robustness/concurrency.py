"""Two `graphopt optimize` runs at once to the same output, round after round.

Each round starts two processes, each optimizing a different model (different weights, so
different data files) into the same ``o.onnx``, at the same moment. After both exit, the
output must be one complete pair: the model of one run with that run's data file (it loads
with its data and computes what one of the two inputs computes). Every data file the output
ever pointed at stays until a later round no longer needs it: graphopt deletes no file it
did not create in that run.

Used by tests/robustness/test_reliability_data_loss.py (a few rounds) and
tools/reliability_report.py (more).
"""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

CLI = [sys.executable, "-P", "-m", "graphopt.cli"]


def _model(seed: int) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    w = numpy_helper.from_array(rng.standard_normal((256, 256)).astype(np.float32), "W")
    graph = helper.make_graph(
        [helper.make_node("Transpose", ["W"], ["Wt"], perm=[1, 0]),
         helper.make_node("MatMul", ["x", "Wt"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 256])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 256])], initializer=[w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _weights_of(path: str) -> np.ndarray | None:
    """The output's W (through its data file), or None when the pair is broken."""
    try:
        proto = onnx.load(path)  # with its external data
    except Exception:  # noqa: BLE001 (a missing or short data file: broken)
        return None
    found = [numpy_helper.to_array(t) for t in proto.graph.initializer if t.name == "W"]
    return found[0] if found else None


def concurrent_rounds(folder: str, rounds: int) -> list[str]:
    """Run ``rounds`` rounds; returns what was wrong, one line per bad round."""
    inputs = {}
    for seed in (1, 2):
        sub = os.path.join(folder, f"in{seed}")
        os.makedirs(sub, exist_ok=True)
        path = os.path.join(sub, "m.onnx")
        onnx.save_model(_model(seed), path, save_as_external_data=True,
                        all_tensors_to_one_file=True, location="w.bin", size_threshold=0)
        inputs[path] = numpy_helper.to_array(_model(seed).graph.initializer[0])
    out_dir = os.path.join(folder, "out")
    os.makedirs(out_dir, exist_ok=True)
    out = os.path.join(out_dir, "o.onnx")
    problems = []
    for round_ in range(rounds):
        procs = [subprocess.Popen([*CLI, "optimize", src, "-o", out, "--disable",
                                   "fold_constants"], stdout=subprocess.DEVNULL,
                                  stderr=subprocess.PIPE, text=True) for src in inputs]
        errors = [p.communicate(timeout=300)[1] for p in procs]
        codes = [p.returncode for p in procs]
        if codes != [0, 0]:
            problems.append(f"round {round_}: exit codes {codes}: {errors}")
            continue
        weights = _weights_of(out)
        if weights is None:
            problems.append(f"round {round_}: {out} points at a missing or short data file")
        elif not any(np.array_equal(weights, w) for w in inputs.values()):
            problems.append(f"round {round_}: {out} holds weights of neither input")
    return problems

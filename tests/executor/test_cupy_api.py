"""The GPU code paths of the kernels, without a GPU.

Every kernel runs with ``ArrayBackend("cuda", RecordingXp())``: the branches a CuPy run
takes, computed by NumPy. Two checks come out of one run over onnx's node test suite
and the training graphs of the fixtures:

* the GPU paths give the right numbers (the suite's expected outputs; the CPU session's
  bits for the training graphs, where the deterministic scatter must match ``ufunc.at``);
* every ``xp.*`` call they make exists in CuPy with those arguments (needs CuPy installed,
  which works on a machine without a GPU: ``pip install cupy-cuda13x``; skipped otherwise).
"""

from __future__ import annotations

import json
import warnings

import numpy as np
import onnx
import pytest
from onnx.backend.test.runner import Runner
from support.cupy_api import RecordingXp, cupy_incompatibilities
from support.models import fixture_path

from graphopt.executor import Session
from graphopt.executor.backend import ArrayBackend
from graphopt.executor.context import KernelContext
from graphopt.executor.kernels._scatter import scatter_rows
from graphopt.executor.numerics.gpu_gemm import blas_matmul
from graphopt.executor.onnx_backend import _as_array
from graphopt.executor.registry import supported_op_types
from graphopt.trainer import RunOptions, run
from graphopt.training import build_training_graph

from .test_onnx_backend import EXCLUDED

TRAINING_FIXTURES = ["mlp", "cnn", "mqa_block", "mqa_dynamo"]


def _node_cases():
    import re

    from onnx.backend.test.loader import load_model_tests

    claimed = supported_op_types()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        cases = load_model_tests(kind="node")
    for case in cases:
        ops = {n.op_type for n in case.model.graph.node if n.domain in ("", "ai.onnx")}
        if not ops or not ops <= claimed:
            continue
        if any(re.search(pattern, case.name) for pattern in EXCLUDED):
            continue
        yield case


def _data_sets(case):
    import glob
    import os

    from onnx import numpy_helper

    if case.model_dir is None:  # cases built in memory carry their data
        for inputs, outputs in case.data_sets:
            yield [_as_array(v) for v in inputs], [_as_array(v) for v in outputs]
        return
    for folder in sorted(glob.glob(os.path.join(case.model_dir, "test_data_set*"))):
        def read(prefix, folder=folder):
            paths = sorted(glob.glob(os.path.join(folder, f"{prefix}_*.pb")))
            tensors = []
            for path in paths:
                tensor = onnx.TensorProto()
                with open(path, "rb") as handle:
                    tensor.ParseFromString(handle.read())
                tensors.append(numpy_helper.to_array(tensor))
            return tensors

        yield read("input"), read("output")


@pytest.fixture(scope="module")
def gpu_path_run(tmp_path_factory):
    """(recorder, failures) of one run of every case through the recording backend."""
    xp = RecordingXp()
    backend = ArrayBackend("cuda", xp)
    failures = []
    for case in _node_cases():
        try:
            model = case.model or onnx.load(f"{case.model_dir}/model.onnx")
            session = Session(model, device=backend)
            names = session.input_names
            for inputs, outputs in _data_sets(case):
                result = session.run(dict(zip(names, inputs, strict=False)))
                got = [np.asarray(result[name]) for name in session.output_names]
                Runner.assert_similar_outputs(outputs, got, case.rtol, case.atol)
        except Exception as exc:  # noqa: BLE001 - collected and reported together
            failures.append(f"{case.name}: {type(exc).__name__}: {str(exc)[:300]}")
    for name in TRAINING_FIXTURES:
        path = fixture_path(f"{name}.onnx")
        data = np.load(fixture_path(f"{name}.npz"))
        meta = json.loads(str(data["__meta__"]))
        training = build_training_graph(path, loss="output").proto
        feeds = {k: data[k] for k in meta["inputs"]}
        feeds["output_grad"] = np.random.default_rng(0).standard_normal(
            data["output"].shape).astype(data["output"].dtype)
        want = Session(training, device="cpu").run(feeds)
        try:
            got = Session(training, device=backend).run(feeds)
            for key, value in want.items():
                np.testing.assert_array_equal(np.asarray(got[key]), value,
                                              err_msg=f"training {name}: {key}")
        except Exception as exc:  # noqa: BLE001
            failures.append(f"training {name}: {type(exc).__name__}: {str(exc)[:300]}")
    # the training loop's device branch (weights, gradients and optimizer state on the device)
    folder = tmp_path_factory.mktemp("train")
    rng = np.random.default_rng(1)
    data = folder / "d.npz"
    np.savez(data, x=rng.standard_normal((16, 64)).astype(np.float32),
             labels=rng.integers(0, 10, 16).astype(np.int64))
    for optimizer in ("adamw", "momentum"):
        try:
            run(RunOptions(model=fixture_path("mlp.onnx"), data=str(data), loss="cross_entropy",
                           steps=3, batch_size=4, optimizer=optimizer, precision="mixed",
                           loss_scale="dynamic:1024:3", device=backend, quiet=True))
        except Exception as exc:  # noqa: BLE001
            failures.append(f"training loop {optimizer}: {type(exc).__name__}: {exc}")
    # the array calls of the GPU GEMM's operand handling (its BLAS calls are checked in
    # tests/executor/numerics/test_gemm_plan.py)
    rng = np.random.default_rng(0)
    for shape_a, shape_b in [((2, 4, 5, 3), (2, 1, 3, 6)), ((4, 5, 3), (6, 3)), ((3,), (3, 2))]:
        a = rng.standard_normal(shape_a).astype(np.float16)
        b = rng.standard_normal(shape_b).astype(np.float16)
        b = b.swapaxes(-1, -2) if shape_b == (6, 3) else b
        blas_matmul(xp, a, b, xp.float16, lambda *args: None)
        if a.ndim > 1:  # rows that no BLAS layout reads: copied first
            blas_matmul(xp, a[..., ::2, :], b, xp.float32, lambda *args: None)
    return xp.recorder, failures


def test_gpu_code_paths_give_the_reference_numbers(gpu_path_run):
    _, failures = gpu_path_run
    assert not failures, "\n".join(failures)


def test_every_array_call_of_the_kernels_exists_in_cupy(gpu_path_run):
    pytest.importorskip("cupy", reason="CuPy not installed (pip install cupy-cuda13x; no GPU "
                                      "needed)")
    recorder, _ = gpu_path_run
    assert len(recorder.calls) > 50  # the run did exercise the kernels
    problems = cupy_incompatibilities(recorder)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.int64, np.bool_])
@pytest.mark.parametrize("reduction", ["add", "mul", "max", "min"])
def test_deterministic_scatter_is_bitwise_ufunc_at(dtype, reduction):
    """The rounds of the GPU path apply duplicates in NumPy's ufunc.at order: same bits."""
    rng = np.random.default_rng(7)
    rows = rng.integers(0, 5, size=200)  # many duplicates per row
    updates = (rng.standard_normal((200, 3)) * 3).astype(dtype)
    base = (rng.standard_normal((5, 3)) * 3).astype(dtype)
    want = base.copy()
    getattr(np, {"add": "add", "mul": "multiply", "max": "maximum",
                 "min": "minimum"}[reduction]).at(want, rows, updates)
    got = base.copy()
    ctx = KernelContext(ArrayBackend("cuda", RecordingXp()), None, False, None)
    scatter_rows(ctx, got, rows, updates, reduction)
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))

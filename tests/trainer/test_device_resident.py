"""Training with the weights kept on the device: the GPU branch of the loop (weights,
gradients and optimizer state left where the session computes them, one finite flag read
back per step, host copies only for checkpoints and the result), run on a stand-in device
whose arrays are NumPy's, ends on exactly the CPU run's weights, through a resume too."""
from __future__ import annotations

import numpy as np
import pytest
from support.cupy_api import RecordingXp
from support.gpu import cupy_with_a_device
from support.training_runs import MLP, mlp_data, write_npz

from graphopt.executor.backend import ArrayBackend
from graphopt.trainer import RunOptions, run
from graphopt.trainer.loop import Trainer


def options(tmp_path, **overrides) -> RunOptions:
    base = dict(model=MLP, data=write_npz(tmp_path / "d.npz", mlp_data(samples=42)),
                loss="cross_entropy", steps=12, batch_size=4, optimizer="adamw", lr=0.01,
                seed=5, device="cpu", quiet=True)
    return RunOptions(**{**base, **overrides})


@pytest.mark.parametrize("optimizer,precision,loss_scale", [
    ("adamw", "fp32", None), ("momentum", "mixed", "dynamic:1024:3"),
])
def test_device_resident_run_equals_the_host_run(tmp_path, optimizer, precision, loss_scale):
    common = dict(optimizer=optimizer, precision=precision, loss_scale=loss_scale)
    host = run(options(tmp_path, **common))
    xp = RecordingXp()
    device = run(options(tmp_path, device=ArrayBackend("cuda", xp),
                         checkpoint=str(tmp_path / "ck"), **common))
    for name, value in host.result.params.items():
        np.testing.assert_array_equal(device.result.params[name], value, err_msg=name)
    assert ("isfinite", 1, frozenset()) in xp.recorder.calls  # the device branch ran
    assert Trainer.weights_on_device
    resumed = run(options(tmp_path, device=ArrayBackend("cuda", RecordingXp()), steps=20,
                          checkpoint=str(tmp_path / "ck"), resume=True, **common))
    straight = run(options(tmp_path, steps=20, **common))
    for name, value in straight.result.params.items():
        np.testing.assert_array_equal(resumed.result.params[name], value, err_msg=name)


@pytest.mark.gpu
def test_gpu_run_keeps_weights_on_the_device_and_matches_the_host(tmp_path):
    cupy = cupy_with_a_device()
    host = run(options(tmp_path))
    device = run(options(tmp_path, device="cuda" if not cupy.cuda.runtime.is_hip else "rocm"))
    for name, value in host.result.params.items():  # GEMM summation order differs
        np.testing.assert_allclose(device.result.params[name], value, rtol=1e-4, atol=1e-5)

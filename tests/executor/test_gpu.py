"""CuPy path: runs only where CuPy and a GPU are present."""

from __future__ import annotations

import numpy as np
import pytest

from graphopt.executor import Session

from .test_yield_training_graph import _analytic, _training_model


def _gpu_device():
    try:
        import cupy
    except ImportError:
        pytest.skip("CuPy is not installed")
    try:
        if cupy.cuda.runtime.getDeviceCount() == 0:
            pytest.skip("no GPU device")
    except Exception:
        pytest.skip("no GPU device")
    return "rocm" if cupy.cuda.runtime.is_hip else "cuda"


@pytest.mark.gpu
def test_training_graph_on_gpu_matches_numpy():
    device = _gpu_device()
    rng = np.random.default_rng(5)
    feeds = {"x": rng.standard_normal((4, 3)).astype(np.float32),
             "w1": rng.standard_normal((3, 5)).astype(np.float32),
             "w2": rng.standard_normal((5, 2)).astype(np.float32)}
    session = Session(_training_model(), device=device)
    assert session.device == device
    out = session.run(feeds)
    assert isinstance(out["w1_grad"], np.ndarray)
    dw1, dw2 = _analytic(feeds["x"], feeds["w1"], feeds["w2"], 1.0)
    np.testing.assert_allclose(out["w1_grad"], dw1, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(out["w2_grad"], dw2, rtol=1e-4, atol=1e-5)

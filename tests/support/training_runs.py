"""Shared pieces of the training-loop tests: the PyTorch-exported MLP fixture and data."""
from __future__ import annotations

import os

import numpy as np

FIXTURES = os.path.join(os.path.dirname(__file__), os.pardir, "fixtures")
MLP = os.path.join(FIXTURES, "mlp.onnx")  # Gemm(64->32, transB) Relu Gemm(32->10); x is [4, 64]


def mlp_data(samples: int = 40, seed: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((samples, 64)).astype(np.float32),
            "labels": rng.integers(0, 10, samples).astype(np.int64)}


def write_npz(path, arrays) -> str:
    np.savez(path, **arrays)
    return str(path)

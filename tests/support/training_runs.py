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


def mlp_with_dynamic_batch(folder) -> str:
    """The MLP fixture with a symbolic batch dimension (the fixture's is fixed at 4)."""
    import onnx

    model = onnx.load(MLP)
    for value in [*model.graph.input[:1], *model.graph.output]:
        dims = value.type.tensor_type.shape.dim
        if dims:
            dims[0].Clear()
            dims[0].dim_param = "batch"
    del model.graph.value_info[:]
    path = os.path.join(str(folder), "mlp_dynamic_batch.onnx")
    onnx.save(model, path)
    return path


def in_epoch_order(arrays: dict, batch_size: int, seed: int) -> dict:
    """The rows laid out so that graphopt's shuffle of epoch 0 hands them out in their stored
    order (step t gets rows batch_size*t ... batch_size*(t+1)-1, as a torch loop took them)."""
    from graphopt.trainer.data import Batches

    n = len(next(iter(arrays.values())))
    order = Batches(arrays, list(arrays), batch_size, seed).order(0)
    laid_out = {}
    for name, value in arrays.items():
        placed = np.empty_like(value)
        placed[order[:n]] = value
        laid_out[name] = placed
    return laid_out

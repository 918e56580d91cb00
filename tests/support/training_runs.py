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


def wide_matmul(folder) -> tuple[str, str]:
    """(model, data): y = x @ W with W 300 x 700 and 2,000 samples of x and an mse target; a
    batch of 1000 makes products OpenBLAS threads, and a training step of some 9 MiB."""
    import onnx
    from onnx import helper, numpy_helper
    weight = np.random.default_rng(3).standard_normal((300, 700)).astype(np.float32) * 0.05
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"])], "wide",
        [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 300])],
        [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", 700])],
        [numpy_helper.from_array(weight, "W")])
    model = f"{folder}/wide.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), model)
    rng = np.random.default_rng(4)
    data = write_npz(f"{folder}/wide.npz",
                     {"x": rng.standard_normal((2000, 300)).astype(np.float32),
                      "target": rng.standard_normal((2000, 700)).astype(np.float32)})
    return model, data


def edited_checkpoint(good: str, target, meta_edit=None, arrays_edit=None) -> str:
    """A copy of the checkpoint folder ``good`` in ``target`` with its metadata and arrays
    edited (as a hand or a tool would), written as a plain .npz."""
    import json
    import os

    from graphopt.trainer import checkpoint as ckpt
    with np.load(ckpt.path_in(good), allow_pickle=False) as archive:
        arrays = {name: archive[name] for name in archive.files}
    meta = json.loads(str(arrays["__meta__"]))
    if meta_edit is not None:
        meta_edit(meta)
    if arrays_edit is not None:
        arrays_edit(arrays)
        meta["optimizer_arrays"] = [k[len("opt/"):] for k in arrays if k.startswith("opt/")]
    arrays["__meta__"] = np.array(json.dumps(meta))
    os.makedirs(target)
    np.savez(ckpt.path_in(str(target)), **arrays)
    return str(target)

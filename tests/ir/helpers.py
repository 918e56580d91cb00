"""The model the loading/saving tests share: a real weight, saved with external data."""
from __future__ import annotations

import os

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

FEEDS = {"x": np.random.default_rng(1).standard_normal((3, 64)).astype(np.float32)}


def weights_model(seed: int = 0) -> onnx.ModelProto:
    """x @ Transpose(W) * 0.5 + b: the FusedMatMul rules fire, W (80x64) stays a weight
    through every rule; ``seed`` gives other values (another output, other data files)."""
    rng = np.random.default_rng(seed)
    w = numpy_helper.from_array(rng.standard_normal((80, 64)).astype(np.float32), "W")
    b = numpy_helper.from_array(rng.standard_normal(80).astype(np.float32), "b")
    s = numpy_helper.from_array(np.array(0.5, np.float32), "s")
    graph = helper.make_graph(
        [helper.make_node("Transpose", ["W"], ["Wt"], perm=[1, 0]),
         helper.make_node("MatMul", ["x", "Wt"], ["p"]),
         helper.make_node("Mul", ["p", "s"], ["q"]),
         helper.make_node("Add", ["q", "b"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 64])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 80])],
        initializer=[w, b, s])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    return model


def save_external(model, folder, name="model.onnx", location="w.bin") -> str:
    """``model`` saved as ``folder/name`` with every tensor in the one file ``location``."""
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, name)
    onnx.save_model(model, path, save_as_external_data=True, all_tensors_to_one_file=True,
                    location=location, size_threshold=0)
    return path

"""Small graph builders shared by the executor tests."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

MS = "com.microsoft"
FLOAT = TensorProto.FLOAT
DOUBLE = TensorProto.DOUBLE


def tensor_type(dtype) -> int:
    return helper.np_dtype_to_tensor_dtype(np.dtype(dtype))


def single_node_model(op_type, inputs: dict, n_outputs=1, domain="", opset=17, attrs=None,
                      output_names=None):
    """A one-node model whose graph inputs are the given example arrays (name -> array)."""
    outs = output_names or [f"y{i}" for i in range(n_outputs)]
    node = helper.make_node(op_type, list(inputs), outs, domain=domain, name="n0", **(attrs or {}))
    graph = helper.make_graph(
        [node], "g",
        [helper.make_tensor_value_info(k, tensor_type(v.dtype), list(v.shape))
         for k, v in inputs.items()],
        [helper.make_empty_tensor_value_info(o) for o in outs],
    )
    opsets = [helper.make_opsetid("", opset), helper.make_opsetid(MS, 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=10)


def run_single(op_type, inputs: dict, n_outputs=1, domain="", opset=17, attrs=None):
    from graphopt.executor import Session

    model = single_node_model(op_type, inputs, n_outputs, domain, opset, attrs)
    result = Session(model, device="cpu").run(inputs)
    return [result[f"y{i}"] for i in range(n_outputs)]


def numeric_grad(f, x: np.ndarray, dy: np.ndarray, eps=1e-6) -> np.ndarray:
    """Central finite differences of sum(f(x) * dy) w.r.t. x (float64)."""
    grad = np.zeros_like(x)
    flat = x.reshape(-1)
    g = grad.reshape(-1)
    for i in range(flat.size):
        orig = flat[i]
        flat[i] = orig + eps
        up = np.sum(f(x) * dy)
        flat[i] = orig - eps
        down = np.sum(f(x) * dy)
        flat[i] = orig
        g[i] = (up - down) / (2 * eps)
    return grad


def check_model(model: onnx.ModelProto) -> None:
    onnx.checker.check_model(model)

"""An MLP for scikit-learn's 8x8 digits (scikit-learn is optional: the ``examples`` extra)."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from graphopt.errors import GraphoptError


def digits_dataset() -> dict[str, np.ndarray]:
    """{"x": [1797, 64] float32 in [0, 1], "labels": [1797] int64}."""
    try:
        from sklearn.datasets import load_digits
    except ImportError:
        raise GraphoptError("--example mlp-digits needs scikit-learn: pip install "
                            "'graphopt[examples]' (or pip install scikit-learn)") from None
    digits = load_digits()
    return {"x": (digits.data / 16.0).astype(np.float32),
            "labels": digits.target.astype(np.int64)}


def build_digits_mlp(hidden: int = 64, seed: int = 0) -> onnx.ModelProto:
    """x [batch, 64] -> MatMul+Add -> Relu -> MatMul+Add -> logits [batch, 10]."""
    rng = np.random.default_rng(seed)

    def init(name, shape, fan_in):
        bound = 1.0 / np.sqrt(fan_in)  # PyTorch nn.Linear's default range
        return numpy_helper.from_array(rng.uniform(-bound, bound, shape).astype(np.float32), name)

    initializers = [init("fc1.weight", [64, hidden], 64), init("fc1.bias", [hidden], 64),
                    init("fc2.weight", [hidden, 10], hidden), init("fc2.bias", [10], hidden)]
    nodes = [
        helper.make_node("MatMul", ["x", "fc1.weight"], ["fc1/mm"], name="/fc1/MatMul"),
        helper.make_node("Add", ["fc1/mm", "fc1.bias"], ["fc1/out"], name="/fc1/Add"),
        helper.make_node("Relu", ["fc1/out"], ["relu"], name="/relu"),
        helper.make_node("MatMul", ["relu", "fc2.weight"], ["fc2/mm"], name="/fc2/MatMul"),
        helper.make_node("Add", ["fc2/mm", "fc2.bias"], ["logits"], name="/fc2/Add"),
    ]
    graph = helper.make_graph(
        nodes, "digits_mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 64])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 10])], initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                              producer_name="graphopt.examples.digits")
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model

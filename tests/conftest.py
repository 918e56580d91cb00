"""Shared helpers: tiny models from ONNX text, fixtures, and onnxruntime as an oracle."""
from __future__ import annotations

import json
import os

import numpy as np
import onnx
import onnx.parser
import pytest

FIXTURES = os.path.join(os.path.dirname(__file__), "fixtures")


def model_from_text(text: str) -> onnx.ModelProto:
    model = onnx.parser.parse_model(text)
    onnx.checker.check_model(model)
    return model


def fixture_path(name: str) -> str:
    return os.path.join(FIXTURES, name)


def fixture_feeds(name: str) -> dict[str, np.ndarray]:
    data = np.load(fixture_path(name.replace(".onnx", ".npz")))
    meta = json.loads(str(data["__meta__"]))
    return {k: data[k] for k in meta["inputs"]}


def run_ort(model: onnx.ModelProto | str, feeds: dict) -> list[np.ndarray]:
    ort = pytest.importorskip("onnxruntime")
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    source = model if isinstance(model, str) else model.SerializeToString()
    return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"]).run(None,
                                                                                          feeds)


def random_feeds(model: onnx.ModelProto, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    initializers = {t.name for t in model.graph.initializer}
    feeds = {}
    for vi in model.graph.input:
        if vi.name in initializers:
            continue
        t = vi.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") else 2 for d in t.shape.dim]
        dtype = onnx.helper.tensor_dtype_to_np_dtype(t.elem_type)
        if np.issubdtype(dtype, np.integer):
            feeds[vi.name] = rng.integers(0, 3, shape).astype(dtype)
        else:
            feeds[vi.name] = rng.standard_normal(shape).astype(dtype)
    return feeds


def assert_same_outputs(before: onnx.ModelProto, after: onnx.ModelProto, feeds=None,
                        rtol=1e-5, atol=1e-6) -> None:
    feeds = feeds if feeds is not None else random_feeds(before)
    for expected, actual in zip(run_ort(before, feeds), run_ort(after, feeds), strict=True):
        np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol)


def op_types(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


FUSED_MATMUL_DEFAULTS = {"alpha": 1.0, "transA": 0, "transB": 0, "transBatchA": 0,
                         "transBatchB": 0}


def fused(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.op_type == "FusedMatMul"]


def fused_attrs(node: onnx.NodeProto) -> dict:
    """A FusedMatMul's attributes with the schema defaults filled in."""
    attrs = dict(FUSED_MATMUL_DEFAULTS)
    attrs.update({a.name: onnx.helper.get_attribute_value(a) for a in node.attribute})
    return attrs

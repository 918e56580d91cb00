"""org.pytorch.aten::ATen nodes as ORTModule writes them (operator attribute + arguments as
inputs): forwards against NumPy, gradients against float64 central finite differences of the
forward kernels. PyTorch's own gradients are checked on ORTModule's training graph
(tests/executor/test_ortmodule_graph.py)."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import helper

from graphopt.executor import Session, UnsupportedOpsError

from .helpers import numeric_grad, tensor_type

ATEN = "org.pytorch.aten"
RNG = np.random.default_rng(17)


def aten(operator: str, inputs: dict, n_outputs=1, overload=""):
    """Run one ATen node whose inputs are the given arrays (None: an omitted input)."""
    names = [name if value is not None else "" for name, value in inputs.items()]
    feeds = {k: v for k, v in inputs.items() if v is not None}
    outputs = [f"y{i}" for i in range(n_outputs)]
    node = helper.make_node("ATen", names, outputs, domain=ATEN, name="aten",
                            operator=operator, overload_name=overload)
    graph = helper.make_graph(
        [node], "g",
        [helper.make_tensor_value_info(k, tensor_type(v.dtype), list(v.shape))
         for k, v in feeds.items()],
        [helper.make_empty_tensor_value_info(o) for o in outputs])
    model = helper.make_model(graph, ir_version=10, opset_imports=[
        helper.make_opsetid("", 17), helper.make_opsetid(ATEN, 1)])
    result = Session(model, device="cpu").run(feeds)
    return [result[o] for o in outputs]


def scalar(value, dtype=np.int64):
    return np.array(value, dtype=dtype)


def embedding(weight, indices, padding_idx=-1, scale_grad_by_freq=False):
    return aten("embedding", {"weight": weight, "indices": indices,
                              "padding_idx": scalar(padding_idx),
                              "scale_grad_by_freq": scalar(scale_grad_by_freq, np.bool_),
                              "sparse": scalar(False, np.bool_)})[0]


def embedding_backward(grad, indices, rows, padding_idx=-1, scale_grad_by_freq=False):
    return aten("embedding_backward", {
        "grad": grad, "indices": indices, "num_weights": scalar(rows),
        "padding_idx": scalar(padding_idx),
        "scale_grad_by_freq": scalar(scale_grad_by_freq, np.bool_),
        "sparse": scalar(False, np.bool_)})[0]


INDICES = np.array([[1, 4, 1], [0, 4, 4]], dtype=np.int64)


def test_embedding_picks_rows():
    weight = RNG.standard_normal((6, 3)).astype(np.float32)
    np.testing.assert_array_equal(embedding(weight, INDICES), weight[INDICES])


def test_embedding_backward_is_the_gradient_of_embedding():
    weight = RNG.standard_normal((6, 3))
    dy = RNG.standard_normal((2, 3, 3))
    expected = numeric_grad(lambda w: embedding(w, INDICES), weight, dy)
    np.testing.assert_allclose(embedding_backward(dy, INDICES, 6), expected, rtol=1e-7,
                               atol=1e-9)


def test_padding_row_gets_no_gradient_and_frequencies_scale_it():
    weight = RNG.standard_normal((6, 3))
    dy = RNG.standard_normal((2, 3, 3))
    expected = numeric_grad(lambda w: embedding(w, INDICES), weight, dy)
    padded = embedding_backward(dy, INDICES, 6, padding_idx=4)
    np.testing.assert_allclose(padded[[0, 1, 2, 3, 5]], expected[[0, 1, 2, 3, 5]], rtol=1e-7)
    assert not padded[4].any()
    counts = np.bincount(INDICES.reshape(-1), minlength=6)[:, None]
    scaled = embedding_backward(dy, INDICES, 6, scale_grad_by_freq=True)
    np.testing.assert_allclose(scaled, expected / np.maximum(counts, 1), rtol=1e-7, atol=1e-9)


def test_argmax_flat_and_along_a_dim():
    x = RNG.standard_normal((3, 4)).astype(np.float32)
    assert aten("argmax", {"x": x, "dim": None, "keepdim": None})[0] == np.argmax(x)
    (along,) = aten("argmax", {"x": x, "dim": scalar(-1), "keepdim": scalar(True, np.bool_)})
    np.testing.assert_array_equal(along, np.argmax(x, axis=1)[:, None])
    assert along.dtype == np.int64


@pytest.mark.parametrize("operator,reduce", [("max", np.max), ("min", np.min)])
def test_max_min_and_the_gradient_of_the_dim_overload(operator, reduce):
    x = RNG.standard_normal((3, 4, 2))
    assert aten(operator, {"x": x})[0] == reduce(x)
    dim, keep = scalar(1), scalar(False, np.bool_)

    def values(v):
        return aten(operator, {"x": v, "dim": dim, "keepdim": keep}, 2, "dim")[0]

    out, indices = aten(operator, {"x": x, "dim": dim, "keepdim": keep}, 2, "dim")
    np.testing.assert_array_equal(out, reduce(x, axis=1))
    dy = RNG.standard_normal(out.shape)
    (dx,) = aten("value_selecting_reduction_backward", {
        "grad": dy, "dim": dim, "indices": indices,
        "sizes": np.array(x.shape, np.int64), "keepdim": keep})
    np.testing.assert_allclose(dx, numeric_grad(values, x, dy), rtol=1e-7, atol=1e-9)


def test_numpy_t_and_bitwise_or():
    x = RNG.standard_normal((2, 3, 4)).astype(np.float32)
    np.testing.assert_array_equal(aten("numpy_T", {"x": x})[0], x.T)
    a, b = np.array([1, 4, 6], np.int64), np.array([2, 4, 1], np.int64)
    np.testing.assert_array_equal(aten("bitwise_or", {"a": a, "b": b}, overload="Tensor")[0],
                                  a | b)


def test_an_unknown_aten_operator_is_reported_before_anything_runs():
    with pytest.raises(UnsupportedOpsError, match="ATen\\(operator='upsample_bicubic2d'\\)"):
        aten("upsample_bicubic2d", {"x": np.zeros((1, 1, 2, 2), np.float32)})

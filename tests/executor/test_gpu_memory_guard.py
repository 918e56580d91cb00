"""The memory guard on a GPU backend, with a stand-in device whose driver reports a fixed
free figure: initializers are uploaded before the reading, so they must not be counted
twice, and memory CuPy's pool holds unused is available again."""

from __future__ import annotations

import types

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from support.cupy_api import RecordingXp

from graphopt.executor import Session
from graphopt.executor.backend import ArrayBackend
from graphopt.executor.memory import ENV, MemoryLimitError

FREE, POOLED = 3 << 20, 1 << 20


class StandInGpu(RecordingXp):
    """NumPy arrays; ``cuda.runtime.memGetInfo`` and the pool answer like CuPy's."""

    def __init__(self):
        super().__init__()
        runtime = types.SimpleNamespace(memGetInfo=lambda: (FREE, 8 * FREE))
        self.cuda = types.SimpleNamespace(runtime=runtime)
        pool = types.SimpleNamespace(free_bytes=lambda: POOLED)
        self.get_default_memory_pool = lambda: pool


def _model_with_weight(nbytes):
    weight = np.zeros(nbytes // 4, np.float32)
    graph = helper.make_graph(
        [helper.make_node("Add", ["x", "w"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [weight.size])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [weight.size])],
        initializer=[numpy_helper.from_array(weight, "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_initializers_count_once_and_pooled_memory_is_available(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    weight_bytes = 2 << 20
    session = Session(_model_with_weight(weight_bytes), device=ArrayBackend("cuda", StandInGpu()))
    guard = session._memory
    assert guard.resident == weight_bytes
    assert guard.available == FREE + POOLED + weight_bytes
    # weights (2 MiB) + x + y (2 MiB each) = 6 MiB, and 6 MiB is what the device can give
    x = np.ones(weight_bytes // 4, np.float32)
    np.testing.assert_array_equal(session.run({"x": x})["y"], x)


def test_an_explicit_limit_is_taken_as_given(monkeypatch):
    monkeypatch.setenv(ENV, str(5 << 20))  # 6 MiB needed: refused before anything runs
    with pytest.raises(MemoryLimitError):
        Session(_model_with_weight(2 << 20), device=ArrayBackend("cuda", StandInGpu()))

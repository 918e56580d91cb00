"""An index below -dim is out of range, as ONNX (and onnxruntime) say: fixing a negative
index once and letting NumPy wrap it again would read another row silently."""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from graphopt.executor import ExecutorError, Session


def _gather(op: str = "Gather") -> Session:
    table = numpy_helper.from_array(np.arange(64 * 2, dtype=np.float32).reshape(64, 2), "t")
    node = helper.make_node(op, ["t", "i"], ["y"], axis=0)
    graph = helper.make_graph([node], "g", [helper.make_tensor_value_info(
        "i", TensorProto.INT64, [None, 2] if op == "GatherElements" else [None])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], [table])
    return Session(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]),
                   device="cpu")


@pytest.mark.parametrize("op", ["Gather", "GatherElements"])
@pytest.mark.parametrize("index", [-65, -70, -128, 64])
def test_an_index_beyond_the_dimension_is_refused(op, index):
    indices = np.array([[0, index]] if op == "GatherElements" else [0, index], np.int64)
    with pytest.raises(ExecutorError, match="index out of range"):
        _gather(op).run({"i": indices})


def test_the_most_negative_valid_index_reads_the_first_row():
    out = _gather().run({"i": np.array([-64, -1], np.int64)})["y"]
    np.testing.assert_array_equal(out, [[0, 1], [126, 127]])

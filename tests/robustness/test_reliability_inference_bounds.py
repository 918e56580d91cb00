"""Shape inference is bounded: ONNX's data propagation may not materialise what a tiny model
asks for (a Concat doubling chain), and inference never copies the weights' bytes.

Each test is named after the class of failure it pins."""
from __future__ import annotations

import resource
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

CLI = [sys.executable, "-P", "-m", "graphopt.cli"]
LIMIT = 1 << 30   # address space for the child: the unbounded inference needs 3.5 GB and more


def doubling_chain(doublings: int, from_constant: bool = True) -> onnx.ModelProto:
    """``s = Concat(s, s)`` ``doublings`` times from a two-element int64 vector, then Size."""
    inits = [numpy_helper.from_array(np.array([2, 3], np.int64), "s0")] if from_constant else []
    nodes = [] if from_constant else [helper.make_node("Shape", ["x"], ["s0"])]
    nodes += [helper.make_node("Concat", [f"s{i}", f"s{i}"], [f"s{i + 1}"], axis=0)
              for i in range(doublings)]
    nodes.append(helper.make_node("Size", [f"s{doublings}"], ["y"]))
    graph = helper.make_graph(nodes, "chain",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("y", TensorProto.INT64, [])],
                              initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def _limited():
    resource.setrlimit(resource.RLIMIT_AS, (LIMIT, LIMIT))


@pytest.mark.parametrize("from_constant", [True, False])
def test_data_propagation_bomb_optimizes_in_little_memory(tmp_path, from_constant):
    path = tmp_path / "chain.onnx"
    onnx.save(doubling_chain(30, from_constant), path)
    result = subprocess.run([*CLI, "optimize", str(path), "--level", "1", "--dry-run", "-q"],
                            capture_output=True, text=True, timeout=120, preexec_fn=_limited)
    assert result.returncode == 0, result.stderr[-800:]
    assert "Traceback" not in result.stderr


def test_data_propagation_bomb_through_the_python_api_in_little_memory(tmp_path):
    path = tmp_path / "chain.onnx"
    onnx.save(doubling_chain(30), path)
    code = ("import graphopt, onnx, sys; m = onnx.load(sys.argv[1]); "
            "graphopt.optimize(m, level=1)")
    result = subprocess.run([sys.executable, "-P", "-c", code, str(path)], capture_output=True,
                            text=True, timeout=120, preexec_fn=_limited)
    assert result.returncode == 0, result.stderr[-800:]


def test_data_propagation_cost_is_bounded_and_small_models_keep_it():
    from graphopt import inference

    small = doubling_chain(4)
    bomb = doubling_chain(30)
    for model, within in ((small, True), (bomb, False)):
        view, _ = inference.weight_free_view(model)
        first = onnx.shape_inference.infer_shapes(view)
        assert (inference.propagation_cost(view, first) <= inference.DATA_PROP_BUDGET) \
            is within
    # where it stays bounded, propagation still runs: the chain's length is known statically
    inferred = inference.infer_shapes(small)
    found = {vi.name: vi for vi in inferred.graph.value_info}
    assert found["s4"].type.tensor_type.shape.dim[0].dim_value == 32


def test_inference_never_copies_the_weights():
    from graphopt import inference

    weight = numpy_helper.from_array(np.ones((512, 512), np.float32), "W")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 512])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                              initializer=[weight])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    view, _ = inference.weight_free_view(model)
    assert view.ByteSize() < 4096 < model.ByteSize()
    inferred = inference.infer_shapes(model)
    y = next(vi for vi in inferred.graph.output if vi.name == "y")
    assert [d.dim_value for d in y.type.tensor_type.shape.dim][1] == 512
    assert model.graph.initializer[0].raw_data == weight.raw_data   # the model is untouched

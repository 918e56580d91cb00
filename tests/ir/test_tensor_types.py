"""The type service: FusedMatMul's flags as onnxruntime reads them (the oracle), the types
after a FusedMatMul, and input shapes substituted without touching the model."""
from __future__ import annotations

import itertools

import numpy as np
import pytest
from onnx import TensorProto, helper

from graphopt.tensor_types import fused_matmul_permutation, infer_types

ort = pytest.importorskip("onnxruntime")


def _fused(a_dims, b_dims, **flags):
    node = helper.make_node("FusedMatMul", ["a", "b"], ["y"], domain="com.microsoft", **flags)
    after = helper.make_node("Relu", ["y"], ["z"])
    graph = helper.make_graph(
        [node, after], "g",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, a_dims),
         helper.make_tensor_value_info("b", TensorProto.FLOAT, b_dims)],
        [helper.make_tensor_value_info("z", TensorProto.FLOAT, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                   helper.make_opsetid("com.microsoft", 1)])


CASES = [((2, 3, 4, 5), (2, 3, 5, 6), {}), ((2, 3, 4, 5), (2, 3, 6, 5), {"transB": 1}),
         ((2, 3, 5, 4), (2, 3, 5, 6), {"transA": 1}),
         ((4, 2, 3, 5), (2, 3, 5, 6), {"transBatchA": 1}),
         ((4, 2, 3, 5), (4, 2, 3, 5), {"transBatchA": 1, "transBatchB": 1, "transB": 1}),
         ((5, 2, 3, 4), (2, 3, 5, 6), {"transBatchA": 1, "transA": 1})]


@pytest.mark.parametrize("a_dims,b_dims,flags", CASES)
def test_fused_matmul_types_as_onnxruntime_computes(a_dims, b_dims, flags):
    model = _fused(list(a_dims), list(b_dims), **flags)
    found = infer_types(model)
    rng = np.random.default_rng(0)
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    (z,) = session.run(None, {"a": rng.standard_normal(a_dims).astype(np.float32),
                              "b": rng.standard_normal(b_dims).astype(np.float32)})
    for name in ("y", "z"):   # the FusedMatMul, and the standard node after it
        dims = [d.dim_value for d in found[name].tensor_type.shape.dim]
        assert dims == list(z.shape), (name, dims, z.shape)


def test_the_permutation_is_a_permutation_and_vectors_take_no_flags():
    for rank, batch, trans in itertools.product(range(2, 6), (False, True), (False, True)):
        assert sorted(fused_matmul_permutation(rank, batch, trans)) == list(range(rank))
    assert fused_matmul_permutation(1, False, True) is None
    assert fused_matmul_permutation(1, False, False) == [0]


def test_input_shapes_are_substituted_without_changing_the_model():
    model = _fused(["n", 3, 4, 5], ["n", 3, 5, 6])
    before = model.SerializeToString()
    found = infer_types(model, {"a": [7, 3, 4, 5], "b": [7, 3, 5, 6]})
    assert [d.dim_value for d in found["z"].tensor_type.shape.dim] == [7, 3, 4, 6]
    assert model.SerializeToString() == before
    symbolic = infer_types(model)
    assert symbolic["z"].tensor_type.shape.dim[0].dim_param == "n"


def _mqa_training_graph():
    from graphopt.examples.mqa import MqaConfig, build_mqa_model
    from graphopt.trainer import build

    config = MqaConfig(vocab=56)
    graph = build(build_mqa_model(config), loss="cross_entropy", labels="labels")
    return config, graph


def test_every_type_stated_for_a_training_graph_is_the_shape_its_run_produces():
    """The backward pass's com.microsoft gradient ops (SoftmaxCrossEntropyLossGrad,
    SoftmaxGrad_13, LayerNormalizationGrad) are typed as the forward tensors they
    differentiate, and so is what comes after them: each stated dim is the one the executor's
    run makes, and each of those ops' outputs has a stated rank."""
    from graphopt.executor import Session

    config, graph = _mqa_training_graph()
    batch = 4
    ids = np.random.default_rng(0).integers(0, config.vocab, (batch, config.seq))
    shapes = {"input_ids": list(ids.shape), "labels": list(ids.shape)}
    found = infer_types(graph.proto, shapes)
    produced = {}

    def on_step(index, node, outputs):
        for name, value in zip(node.outputs, outputs, strict=False):
            if name and value is not None:
                produced[name] = value.shape

    feeds = {"input_ids": ids, "labels": np.roll(ids, -1, axis=1), **graph.initial}
    Session(graph.proto, device="cpu").run(feeds, graph.losses, on_step=on_step)
    compared = 0
    for name, shape in produced.items():
        type_proto = found.get(name)
        if type_proto is None or not type_proto.tensor_type.HasField("shape"):
            continue
        dims = type_proto.tensor_type.shape.dim
        assert len(dims) == len(shape), name
        for dim, size in zip(dims, shape, strict=True):
            if dim.HasField("dim_value"):
                assert dim.dim_value == size, (name, dims, shape)
        compared += 1
    gradient_ops = {"SoftmaxCrossEntropyLossGrad", "SoftmaxGrad_13", "LayerNormalizationGrad"}
    outputs = [o for n in graph.proto.graph.node if n.op_type in gradient_ops
               for o in n.output if o]
    assert {n.op_type for n in graph.proto.graph.node} & gradient_ops == gradient_ops
    untyped = [o for o in outputs if o not in found
               or not found[o].tensor_type.HasField("shape")]
    assert not untyped
    assert compared > len(produced) // 2

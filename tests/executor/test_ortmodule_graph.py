"""ORTModule's own training graph (tests/fixtures/make_ortmodule_fixture.py: onnxruntime-training
1.19.2, a tiny language model with nn.Embedding) runs in the executor, as it is and optimized,
and its parameter gradients equal PyTorch autograd's. The embedding is an
org.pytorch.aten::ATen node and its gradient an ATen embedding_backward."""

from __future__ import annotations

import json
import os

import numpy as np
import onnx
import pytest

import graphopt
from graphopt.executor import Session

FIXTURE = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures", "ortmodule_lm")


@pytest.fixture(scope="module")
def fixture():
    data = np.load(FIXTURE + ".npz")
    return onnx.load(FIXTURE + ".onnx"), data, json.loads(str(data["__meta__"]))


def test_the_graph_is_ortmodules_with_aten_embedding(fixture):
    model, _, meta = fixture
    aten = [(n.op_type, onnx.helper.get_attribute_value(n.attribute[0]))
            for n in model.graph.node if n.domain == "org.pytorch.aten"]
    assert sorted(op for _, op in aten) == [b"embedding", b"embedding_backward"]
    assert "com.microsoft:YieldOp:" in meta["ops"]


@pytest.mark.parametrize("level", [None, 2])
def test_gradients_equal_pytorch(fixture, level):
    model, data, meta = fixture
    if level is not None:
        model, _ = graphopt.optimize(model, level=level)
    feeds = {name: data[name] for name in meta["inputs"]}
    grads = Session(model, device="cpu", numerics=None).run(feeds, meta["grads"])
    assert len(meta["grads"]) == 9  # embedding, LayerNorm, three Linears: weights and biases
    for name in meta["grads"]:
        np.testing.assert_allclose(grads[name], data[name], rtol=1e-5, atol=1e-6, err_msg=name)

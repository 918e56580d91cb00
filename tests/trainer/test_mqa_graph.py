"""The MQA example's rewritten training graph: the Falcon Slice/Gather/Gather became one
Split in the forward part, its gradient is one Concat, the backward GEMMs are FusedMatMul
nodes carrying __backwardpass=1, and no forward node carries the mark."""
from __future__ import annotations

import onnx
import pytest

from graphopt.examples import load_example
from graphopt.trainer import build

ATTR = "__backwardpass"


def marked(node) -> bool:
    return any(a.name == ATTR and a.i == 1 for a in node.attribute)


@pytest.fixture(scope="module")
def graph():
    example = load_example("mqa")
    return build(example.model, loss="cross_entropy", labels="labels", level=2)


def test_forward_model_has_the_falcon_pattern():
    nodes = load_example("mqa").model.graph.node
    readers = [n for n in nodes if "attn/fused_qkv" in n.input]
    assert sorted(n.op_type for n in readers) == ["Gather", "Gather", "Slice"]


def test_split_forward_concat_backward_fused_matmul_marked(graph):
    nodes = list(graph.proto.graph.node)
    yield_index = next(i for i, n in enumerate(nodes) if n.op_type == "YieldOp")
    forward, backward = nodes[:yield_index], nodes[yield_index:]

    splits = [n for n in forward if n.op_type == "Split"]
    assert len(splits) == 1 and splits[0].input[0] == "attn/fused_qkv"
    assert not any(n.op_type in ("Slice", "Gather") and "attn/fused_qkv" in n.input
                   for n in nodes)
    concats = [n for n in backward if n.op_type == "Concat"]
    assert len(concats) == 1 and marked(concats[0])
    assert concats[0].name.startswith(splits[0].name)  # the Split's gradient
    assert not any(n.op_type in ("SliceGrad",) for n in nodes)

    backward_fused = [n for n in backward if n.op_type == "FusedMatMul"]
    assert len(backward_fused) >= 8 and all(marked(n) for n in backward_fused)
    assert all(marked(n) for n in backward)
    assert not any(marked(n) for n in forward)
    onnx.checker.check_model(graph.proto)


def test_rules_fired_and_reported(graph):
    assert {"gather_slice_to_split", "mark_backward_pass",
            "matmul_transpose_to_fused_matmul"} <= set(graph.fired)


def test_disabling_the_split_fusion_keeps_slice_and_gathers():
    example = load_example("mqa")
    plain = build(example.model, loss="cross_entropy", labels="labels",
                  disable=("gather_slice_to_split",))
    ops = [n.op_type for n in plain.proto.graph.node]
    assert "Split" not in ops and "SliceGrad" in ops and ops.count("GatherGrad") == 3

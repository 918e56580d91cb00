"""Nodes a rewrite creates stay pending (template, name, edges) until their proto is needed:
the graph must behave as if they were built at once."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from support.models import model_from_text, run_ort

from graphopt import modelio
from graphopt.api import select_rules
from graphopt.dsl import Rule, op, var
from graphopt.engine import Engine
from graphopt.ir import PendingNode
from graphopt.matching import NodeView
from graphopt.report import Report

FUSION = "matmul_transpose_to_fused_matmul"

# Two MatMuls, each with a transposed operand; the second reads the first.
CHAIN = model_from_text("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[4,3] a, float[5,3] w, float[6,5] v) => (float[4,6] y) {
      wt = Transpose <perm = [1, 0]> (w)
      m = MatMul(a, wt)
      vt = Transpose <perm = [1, 0]> (v)
      y = MatMul(m, vt)
    }""")

# Both operands transposed: the second rewrite matches on the node the first one made.
BOTH_TRANSPOSED = model_from_text("""
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[3,4] a, float[5,3] b) => (float[4,5] y) {
      at = Transpose <perm = [1, 0]> (a)
      bt = Transpose <perm = [1, 0]> (b)
      y = MatMul(at, bt)
    }""")


def _rewritten(proto, *, validate_each=False):
    model = modelio.load(proto)
    report = Report()
    Engine(select_rules([FUSION]), validate_each=validate_each).run(model, report)
    return model, report


def test_new_nodes_stay_pending_until_written():
    model, report = _rewritten(CHAIN)
    assert report.rules[FUSION].rewrites == 2
    pending = [n for n in model.graph.nodes.values() if type(n) is PendingNode]
    assert [n.op_type for n in pending] == ["FusedMatMul", "FusedMatMul"]
    out = model.flush()
    assert [n.op_type for n in out.graph.node] == ["FusedMatMul", "FusedMatMul"]
    onnx.checker.check_model(out, full_check=True)


def test_written_model_is_byte_identical_to_building_each_node_at_once():
    """validate_each takes the general path, which builds every proto as it goes."""
    for proto in (CHAIN, BOTH_TRANSPOSED):
        fast, _ = _rewritten(proto)
        built, _ = _rewritten(proto, validate_each=True)
        assert not any(type(n) is PendingNode for n in built.graph.nodes.values())
        assert fast.flush().SerializeToString() == built.flush().SerializeToString()


def test_flushing_twice_writes_the_same_model():
    model, _ = _rewritten(CHAIN)
    first = model.flush().SerializeToString()
    model.graph.changed = True
    assert model.flush().SerializeToString() == first


def test_a_rule_reads_the_attributes_of_a_pending_node():
    """MatMul(Transpose(a), Transpose(b)): transA comes first, and the FusedMatMul it made
    (still pending) is matched again, its flags read, and transB absorbed."""
    model, report = _rewritten(BOTH_TRANSPOSED)
    assert report.rules[FUSION].rewrites == 2
    (node,) = model.flush().graph.node
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    assert (node.input, attrs["transA"], attrs["transB"]) == (["a", "b"], 1, 1)
    rng = np.random.default_rng(0)
    feeds = {"a": rng.random((3, 4), np.float32), "b": rng.random((5, 3), np.float32)}
    (expected,) = run_ort(BOTH_TRANSPOSED, feeds)
    (actual,) = run_ort(model.flush(), feeds)
    np.testing.assert_allclose(actual, expected, rtol=1e-6)


def test_reading_a_pending_node_builds_it_once():
    model, _ = _rewritten(CHAIN)
    graph = model.graph
    node_id = next(i for i, n in graph.nodes.items() if type(n) is PendingNode)
    pending = graph.nodes[node_id]
    view = NodeView(graph, node_id)
    assert view.name == pending.name and view.op_type == "FusedMatMul"
    assert view.attr("transB") == 1 and type(graph.nodes[node_id]) is PendingNode
    proto = view.proto
    assert isinstance(proto, onnx.NodeProto) and graph.node(node_id) is proto
    assert (proto.name, tuple(proto.input), tuple(proto.output)) == \
        (pending.name, pending.input, pending.output)


def test_changes_to_a_pending_node_build_it_and_roll_back():
    model, _ = _rewritten(CHAIN)
    graph = model.graph
    node_id = next(i for i, n in graph.nodes.items() if type(n) is PendingNode)
    before = model.flush().SerializeToString()
    graph.begin()
    graph.set_attribute(node_id, onnx.helper.make_attribute("__backwardpass", 1))
    graph.replace_input(node_id, 0, "a")
    assert graph.attr(node_id, "__backwardpass") == 1
    assert list(graph.node(node_id).input)[0] == "a"
    graph.rollback()
    graph.changed = True
    assert model.flush().SerializeToString() == before


def test_a_removed_pending_node_comes_back_on_rollback():
    model, _ = _rewritten(CHAIN)
    graph = model.graph
    before = model.flush().SerializeToString()
    graph.begin()
    for node_id in [i for i, n in graph.nodes.items() if type(n) is PendingNode]:
        graph.remove_node(node_id)
    graph.rollback()
    graph.changed = True
    assert model.flush().SerializeToString() == before


@pytest.mark.parametrize("op_type", ["Relu", "FusedMatMul"])
def test_only_nodes_without_annotations_or_inference_stay_pending(op_type):
    """A standard-domain node is built for per-node inference; a node inheriting
    __backwardpass is built with it."""
    x = var("x")
    make = (lambda m: op.Relu(m.x)) if op_type == "Relu" else \
        (lambda m: op.ms.FusedMatMul(m.x, m.x, transB=1))
    rule = Rule(name=f"test_to_{op_type}", description="test", match=op.Sigmoid(x),
                rewrite=make)
    proto = model_from_text("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[3,3] x) => (float[3,3] y, float[3,3] z) {
          y = Sigmoid(x)
          z = Sigmoid <__backwardpass = 1> (y)
        }""")
    model = modelio.load(proto, check=False)
    Engine([rule]).run(model, Report())
    kinds = {type(model.graph.nodes[i]).__name__: model.graph.nodes[i]
             for i in model.graph.sorted_ids()}
    if op_type == "Relu":
        assert set(kinds) == {"NodeProto"}
    else:
        assert set(kinds) == {"PendingNode", "NodeProto"}
        assert kinds["NodeProto"].attribute[-1].name == "__backwardpass"


def test_a_custom_domain_node_replaces_its_root_in_place():
    """A node of a domain graphopt knows nothing of (its subgraphs are found from its
    attributes) takes the root's place and id; the model keeps the root's position."""
    x = var("x")
    rule = Rule(name="test_to_custom", description="test", match=op.Sigmoid(x),
                rewrite=lambda m: op.domain("test.custom").Swish(m.x, beta=1.0))
    proto = model_from_text("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[3] x) => (float[3] z) {
          y = Sigmoid(x)
          z = Relu(y)
        }""")
    model = modelio.load(proto)
    sigmoid = model.graph.nodes_of_type("Sigmoid")[0]
    Engine([rule]).run(model, Report())
    assert model.graph.op_key(sigmoid) == ("test.custom", "Swish")
    assert type(model.graph.nodes[sigmoid]) is PendingNode
    out = model.flush()
    assert [(n.domain, n.op_type) for n in out.graph.node] == [("test.custom", "Swish"),
                                                                ("", "Relu")]
    assert {o.domain for o in out.opset_import} == {"", "test.custom"}


def test_replacing_a_node_in_place_rolls_back():
    model = modelio.load(CHAIN)
    graph = model.graph
    matmul = graph.nodes_of_type("MatMul")[0]
    before, proto_before = graph.index_snapshot(), model.flush().SerializeToString()
    graph.begin()
    graph.replace_node(matmul, PendingNode("FusedMatMul", "com.microsoft", {"transB": 1},
                                           "fused", ("a", "w"), ("m",)),
                       ("a", "w"), ("com.microsoft", "FusedMatMul"))
    assert matmul in graph.consumers_of("w") and not graph.consumer_count("wt")
    assert graph.nodes_of_type("FusedMatMul", "com.microsoft") == [matmul]
    graph.rollback()
    assert graph.index_snapshot() == before
    graph.changed = True
    assert model.flush().SerializeToString() == proto_before


def test_rules_after_an_in_place_rewrite_do_not_see_the_new_node_as_the_old_op():
    """Two rules anchored at Sigmoid: once the first has put another op in the node's
    place (same id), the second must not match the node as a Sigmoid."""
    x = var("x")
    to_custom = Rule(name="test_sigmoid_to_custom", description="test", match=op.Sigmoid(x),
                     rewrite=lambda m: op.domain("test.custom").Swish(m.x))
    to_relu = Rule(name="test_sigmoid_to_relu", description="test", match=op.Sigmoid(x),
                   rewrite=lambda m: op.Relu(m.x))
    proto = model_from_text("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[3] x) => (float[3] y) {
          y = Sigmoid(x)
        }""")
    model = modelio.load(proto)
    report = Report()
    Engine([to_custom, to_relu]).run(model, report)
    assert [n.op_type for n in model.flush().graph.node] == ["Swish"]
    assert report.rules["test_sigmoid_to_relu"].rewrites == 0

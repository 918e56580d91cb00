"""Differential test of the two matchers generated from one pattern: at every anchor node of
random graphs, the fast matcher the engine runs and the explaining matcher (the one --explain
and fan-out rules run, which says why a candidate misses) agree on whether a pattern matches
and on everything it binds, for patterns using each feature of the pattern language."""
from __future__ import annotations

import numpy as np
from hypothesis import given
from support.models import model_from_text

from graphopt import modelio
from graphopt.dsl import attr, const, one_of, op, scalar_const, var
from graphopt.matching import CompiledPattern, Miss

from .graphs import graphs

a, b, c, x = var("a"), var("b"), var("c"), var("x")

PATTERNS = {
    "nested producer under a commutative op": op.Mul(op.MatMul(a, b), c),
    "one tensor in two places": op.Add(x, x),
    "commutative op over two producers sharing a tensor":
        op.Add(op.Mul(a, b, _name="left"), op.Mul(a, c, _name="right")),
    "literal attribute": op.Transpose(x, perm=[1, 0]),
    "attribute bound, with a default": op.Transpose(x, perm=attr("perm", "absent")),
    "attribute predicate": op.Softmax(x, axis=lambda v: v is None or v == -1),
    "scalar constant": op.Mul(x, scalar_const("s")),
    "constant with a predicate": op.Div(x, const("d", lambda v: bool(np.all(v != 0)))),
    "second output of a multi-output producer": op.MatMul(op.Split(x, _outputs=2)[1], b),
    "first output of a multi-output producer": op.Add(op.Split(x, _outputs=2)[0], b),
    "two levels, attributes at both": op.Transpose(op.Transpose(x, perm=attr("inner")),
                                                   perm=attr("outer"), _name="t"),
    "constant operand of a gather": op.Gather(x, const("i"), axis=attr("axis", 0)),
    "alternatives at one anchor": one_of(op.MatMul(op.Transpose(a), b, _name="m"),
                                         op.MatMul(a, op.Transpose(b), _name="m"),
                                         op.MatMul(a, b, _name="m")),
}


def _agree(graph, compiled: CompiledPattern, node_id: int) -> bool:
    """Whether the pattern matched at ``node_id``; fails if the two matchers disagree."""
    key = graph.op_key(node_id)
    generated = compiled.fast_by_key[key](graph)(node_id)
    explained = compiled.match(graph, node_id)
    if isinstance(explained, Miss):
        assert generated is None, f"fast matched where the explaining matcher says: {explained}"
        return False
    assert generated is not None, "the explaining matcher matched, the fast one did not"
    bindings, roots = explained
    assert dict(generated._bindings) == dict(bindings)
    assert generated._kinds == bindings.kinds
    assert generated.nodes == bindings.nodes and generated.roots == roots
    return True


COMPILED = {name: CompiledPattern(pattern) for name, pattern in PATTERNS.items()}

# Every pattern above matches somewhere here (and most miss elsewhere).
EVERY_FEATURE = model_from_text("""
    <ir_version: 8, opset_import: ["" : 18]>
    g (float[4,4] p, float[4,4] q, float[4,4] r) => (float[4,4] o1, float[4,4] o2,
        float[4,4] o3, float[4,4] o4, float[4,4] o5, float[4,4] o6, float[2,4] o7,
        float[2,4] o8, float[4,4] o9, float[2,4] o10, float[4,4] o11, float[4,4] o12) {
      two = Constant <value = float {2.0}> ()
      zero = Constant <value = float[2] {0.0, 1.0}> ()
      idx = Constant <value = int64[2] {0, 1}> ()
      mm = MatMul(p, q)
      o1 = Mul(r, mm)
      o2 = Add(p, p)
      pq = Mul(p, q)
      pr = Mul(p, r)
      o3 = Add(pr, pq)
      qr = Mul(q, r)
      o4 = Add(pq, qr)
      tp = Transpose <perm = [1, 0]> (p)
      tq = Transpose (q)
      o5 = Transpose <perm = [1, 0]> (tp)
      o6 = Softmax <axis = -1> (tq)
      s1, s2 = Split <axis = 0, num_outputs = 2> (r)
      o7 = Div(s1, zero)
      o8 = Div(s2, two)
      o9 = MatMul(p, tq)
      o10 = MatMul(s2, q)
      o11 = Mul(o9, two)
      o12 = Softmax <axis = 0> (o5)
      g1 = Gather <axis = 1> (p, idx)
      g2 = Add(s1, s2)
    }""")


def test_every_pattern_matches_the_same_way_on_a_graph_with_every_feature():
    graph = modelio.load(EVERY_FEATURE, check=False).graph
    matched = dict.fromkeys(PATTERNS, 0)
    for name, compiled in COMPILED.items():
        for key in compiled.anchor_types:
            for node_id in graph.nodes_of_type(key[1], key[0]):
                matched[name] += _agree(graph, compiled, node_id)
    assert [n for n, count in matched.items() if not count] == []


@given(graphs())
def test_fast_and_explaining_matchers_agree_on_random_graphs(model_and_info):
    model, _ = model_and_info
    graph = modelio.load(model, check=False).graph
    for compiled in COMPILED.values():
        for key in compiled.anchor_types:
            for node_id in graph.nodes_of_type(key[1], key[0]):
                _agree(graph, compiled, node_id)

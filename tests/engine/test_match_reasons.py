"""What --explain says when a pattern misses, one pattern feature at a time, and that the
engine's fast matcher (generated from the same description) misses there too."""
from __future__ import annotations

import pytest
from support.models import model_from_text

from graphopt import modelio
from graphopt.dsl import const, fan_out, one_of, op, produced_by, scalar_const, var
from graphopt.matching import CompiledPattern, Miss, compiled_pattern

a, b, c, x = var("a"), var("b"), var("c"), var("x")

GRAPH = """
    <ir_version: 8, opset_import: ["" : 18]>
    g (float[2,2] p, float[2,2] q) => (float[2,2] out) {
      two = Constant <value = float {2.0}> ()
      pair = Constant <value = float[2] {1.0, 2.0}> ()
      sg = Sigmoid(p)
      r1 = Relu(sg)
      r2 = Relu(p)
      tp = Transpose <perm = [1, 0]> (p)
      sm = Softmax <axis = -1> (p)
      ad = Add(p, q)
      mu = Mul(p, q)
      d1 = Div(p, pair)
      d2 = Div(p, two)
      s1, s2 = Split <axis = 0, num_outputs = 2> (p)
      r3 = Relu(s1)
      mm = MatMul(p, q)
      ad2 = Add(p, mm)
      out = Identity(p)
    }"""

CASES = [
    ("an op check", op.Relu(op.Transpose(x)), "r1", "Sigmoid (unnamed) is not Transpose"),
    ("an arity check", op.Relu(x, b), "r2", "Relu (unnamed) has 1 inputs, pattern needs 2"),
    ("a literal attribute", op.Transpose(x, perm=[0, 1]), "tp",
     "Transpose (unnamed) attribute perm=[1, 0], pattern needs [0, 1]"),
    ("an attribute predicate", op.Softmax(x, axis=lambda v: v == 0), "sm",
     "Softmax (unnamed) attribute axis=-1 rejected"),
    ("one tensor in two places (first order kept on a tie)", op.Add(x, x), "ad",
     "'x' must be the same tensor in both places (p vs q)"),
    ("a constant", op.Mul(x, scalar_const("s")), "mu", "'s' (q) is not a constant"),
    ("a scalar constant", op.Div(x, scalar_const("s")), "d1",
     "'s' (pair) has 2 elements, not one"),
    ("a constant predicate", op.Div(x, const("d", lambda v: False, "d is rejected")), "d2",
     "'d' (two): d is rejected"),
    ("a producer", op.Relu(op.Sigmoid(x)), "r2", "'p' is not produced by a Sigmoid node"),
    ("an output index", op.Relu(op.Split(x, _outputs=2)[1]), "r3",
     "'s1' is not output 1 of Split (unnamed)"),
    # Add(p, mm): in the order (p, mm) the MatMul is missing at once; in (mm, p) the MatMul
    # matches and then p is no Relu: the order that got further is the one reported
    ("a commutative op's near miss", op.Add(op.MatMul(a, b), op.Relu(c)), "ad2",
     "'p' is not produced by a Relu node"),
    ("alternatives at one anchor, all missing",
     one_of(op.Relu(op.Transpose(x)), op.Relu(op.Softmax(x))), "r2",
     "'p' is not produced by a Transpose node; 'p' is not produced by a Softmax node"),
]


@pytest.fixture(scope="module")
def graph():
    return modelio.load(model_from_text(GRAPH), check=False).graph


@pytest.mark.parametrize("feature, pattern, at, reason", CASES, ids=[c[0] for c in CASES])
def test_explain_says_why_and_the_fast_matcher_misses_too(graph, feature, pattern, at, reason):
    compiled = CompiledPattern(pattern)
    anchor = graph.producer_of(at)
    found = compiled.match(graph, anchor)
    assert isinstance(found, Miss) and str(found) == reason
    assert compiled.fast_by_key[graph.op_key(anchor)](graph)(anchor) is None


def test_alternatives_match_at_the_first_that_fits(graph):
    compiled = CompiledPattern(one_of(op.Relu(op.Transpose(x)), op.Relu(op.Sigmoid(x))))
    anchor = graph.producer_of("r1")
    bindings, roots = compiled.match(graph, anchor)
    fast = compiled.fast_by_key[("", "Relu")](graph)(anchor)
    assert dict(bindings) == {"x": "p"} == dict(fast._bindings)
    assert bindings.nodes == [anchor, graph.producer_of("sg")] == fast.nodes == fast.roots + [
        graph.producer_of("sg")] and roots == [anchor]


def test_a_fan_out_says_how_many_consumers_it_found(graph):
    compiled = CompiledPattern(fan_out(x, consumers=("Gather", "Slice")))
    assert str(compiled.match(graph, "p")) == "'p' has 0 Gather/Slice consumer(s), needs at least 2"


def test_a_name_bound_as_two_kinds_is_refused_when_the_rule_is_compiled():
    with pytest.raises(TypeError, match="binds 'x' both as a tensor and as a node"):
        CompiledPattern(op.Add(x, op.Relu(b, _name="x")))


def test_a_pattern_is_compiled_once_per_process(graph):
    # rules are module-level objects: a second optimize reuses their generated matchers
    pattern = one_of(op.Relu(op.Transpose(x)), op.Relu(op.Sigmoid(x)))
    compiled = compiled_pattern(pattern)
    assert compiled_pattern(pattern) is compiled
    assert compiled_pattern(one_of(op.Relu(x))) is not compiled
    anchor = graph.producer_of("r1")
    assert compiled.match(graph, anchor)[1] == [anchor]  # explained on demand, the same way


def test_a_sub_pattern_constraint_binds_the_same_tensor_and_says_why_not(graph):
    """produced_by: ad2 = Add(p, mm) and mm = MatMul(p, q), read by ad2 alone."""
    found = CompiledPattern(op.Add(x, var("m"))).fast_by_key[("", "Add")](graph)(
        graph.producer_of("ad2"))
    assert produced_by("m", op.MatMul(x, var("y")), shared=("x",))(found) is True
    other = produced_by("m", op.MatMul(var("y"), x), shared=("x",), what="a product by x")
    assert other(found) == "'m' is not a product by x of the same 'x'"
    transposed = produced_by("m", op.Transpose(var("y")), what="a Transpose")
    assert transposed(found) == "'m' is not a Transpose: MatMul (unnamed) is not Transpose"

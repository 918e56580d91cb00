"""The rewrite engine: matcher features, worklist, determinism, rollback, provenance."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from support.models import assert_same_outputs, model_from_text, op_types

import graphopt
from graphopt import (
    Pass,
    Rule,
    check,
    const,
    constant,
    fan_out,
    is_float,
    one_of,
    op,
    scalar_const,
    var,
)
from graphopt.errors import GraphoptError

CHAIN = """
<ir_version: 8, opset_import: ["": 17]>
g (float[2, 3] x, float[3, 4] w) => (float[2, 4] y) {
    t = Transpose <perm = [1, 0]> (w)
    tt = Transpose <perm = [1, 0]> (t)
    m = MatMul (x, tt)
    two = Constant <value = float {2.0}> ()
    y = Mul (two, m)
}
"""

a, b, c = var("a"), var("b"), var("c")


def rule(name, match, rewrite, **kw):
    return Rule(name=name, description=name, match=match, rewrite=rewrite, **kw)


DOUBLE_TRANSPOSE = rule("cancel_transposes",
                        op.Transpose(op.Transpose(a, perm=[1, 0]), perm=[1, 0]),
                        lambda m: m.a)


def test_pattern_rewrite_and_numerics():
    model = model_from_text(CHAIN)
    out, report = graphopt.optimize(model, rules=[DOUBLE_TRANSPOSE])
    assert op_types(out) == ["MatMul", "Constant", "Mul"]
    assert report.rules["cancel_transposes"].rewrites == 1
    assert_same_outputs(model, out)


def test_input_model_is_not_modified():
    model = model_from_text(CHAIN)
    before = model.SerializeToString()
    graphopt.optimize(model, rules=[DOUBLE_TRANSPOSE])
    assert model.SerializeToString() == before


def test_commutative_operands_matched_in_either_order():
    # Mul(two, m) with the pattern written as Mul(m-producer, scalar): the matcher swaps.
    seen = []
    r = rule("mul_by_two", op.Mul(op.MatMul(a, b), scalar_const("c")),
             lambda m: seen.append(float(m.c)) or None)
    graphopt.optimize(model_from_text(CHAIN), rules=[r])
    assert seen == [2.0]


def test_attribute_constraints_and_bindings():
    perms = []
    r = rule("see_perm", op.Transpose(a, perm=graphopt.attr("p")),
             lambda m: perms.append(list(m.p)) or None)
    graphopt.optimize(model_from_text(CHAIN), rules=[r])
    assert perms == [[1, 0], [1, 0]]
    never = rule("wrong_perm", op.Transpose(a, perm=[0, 1]), lambda m: m.a)
    _, report = graphopt.optimize(model_from_text(CHAIN), rules=[never], explain=["wrong_perm"])
    assert report.rules["wrong_perm"].rewrites == 0
    assert "perm=[1, 0], pattern needs [0, 1]" in report.format_explain("wrong_perm")


def test_same_variable_twice_must_bind_same_tensor():
    text = """
    <ir_version: 8, opset_import: ["": 17]>
    g (float[2] x, float[2] z) => (float[2] y, float[2] q) {
        y = Add (x, x)
        q = Add (x, z)
    }"""
    r = rule("double", op.Add(a, a), lambda m: op.Mul(m.a, constant(np.float32(2.0))))
    out, report = graphopt.optimize(model_from_text(text), rules=[r])
    assert report.rules["double"].rewrites == 1
    assert op_types(out) == ["Mul", "Add"]
    assert [n.output[0] for n in out.graph.node] == ["y", "q"]


def test_where_constraints_report_reasons():
    r = rule("never", op.MatMul(a, b), lambda m: None,
             where=[check(lambda m: False, "because I said so")])
    _, report = graphopt.optimize(model_from_text(CHAIN), rules=[r], explain=["never"])
    assert "because I said so" in report.format_explain("never")
    ints = """
    <ir_version: 8, opset_import: ["": 17]>
    g (int32[2, 2] x, int32[2, 2] w) => (int32[2, 2] y) { y = MatMul (x, w) }"""
    r2 = rule("floats_only", op.MatMul(a, b), lambda m: None,
              where=[is_float("a", "b", reason="needs floats")])
    _, report = graphopt.optimize(model_from_text(ints), rules=[r2], explain=["floats_only"])
    assert "needs floats" in report.format_explain("floats_only")


def test_const_pattern_sees_initializers_and_constant_nodes():
    values = []
    r = rule("see_const", op.Mul(a, const("k")), lambda m: values.append(m.k.value) or None)
    graphopt.optimize(model_from_text(CHAIN), rules=[r])
    assert len(values) == 1 and values[0] == np.float32(2.0)


def test_fan_out_binds_tensor_and_its_consumers():
    text = """
    <ir_version: 8, opset_import: ["": 17]>
    g (float[4] x) => (float[4] r, float[4] s, float[4] t) {
        r = Relu (x)
        s = Sigmoid (x)
        t = Relu (x)
    }"""
    seen = []
    r = rule("fan", fan_out(var("x"), ["Relu"], min_consumers=2),
             lambda m: seen.append((m.x.name, [n.op_type for n in m.consumers])) or None)
    graphopt.optimize(model_from_text(text), rules=[r])
    assert seen == [("x", ["Relu", "Relu"])]  # tried once, not once per consumer


def test_candidates_come_from_the_op_type_index():
    r = rule("only_matmul", op.MatMul(a, b), lambda m: None)
    _, report = graphopt.optimize(model_from_text(CHAIN), rules=[r])
    assert report.rules["only_matmul"].candidates == 1


def test_output_is_deterministic_and_second_run_changes_nothing():
    model = onnx.load("tests/fixtures/mqa_block.onnx")
    first, _ = graphopt.optimize(model)
    again, _ = graphopt.optimize(model)
    assert first.SerializeToString() == again.SerializeToString()
    second, report = graphopt.optimize(first)
    assert report.total_rewrites == 0
    assert second.SerializeToString() == first.SerializeToString()


def test_new_names_are_unique_even_when_hints_collide():
    text = """
    <ir_version: 8, opset_import: ["": 17]>
    g (float[2] x) => (float[2] y) {
        y = Relu (x)
        dup = Identity (x)
    }"""
    model = model_from_text(text)
    model.graph.node[0].name = "relu"
    model.graph.node[1].name = "relu/Sigmoid"  # the name the new node would be given
    r = rule("relu_to_sigmoid", op.Relu(a), lambda m: op.Sigmoid(m.a))
    out, _ = graphopt.optimize(model, rules=[r])
    assert [n.name for n in out.graph.node] == ["relu/Sigmoid_1", "relu/Sigmoid"]
    assert out.graph.node[0].output[0] == "y"


def test_rewrite_that_breaks_types_is_rolled_back_and_reported():
    bad = rule("to_int", op.Relu(a), lambda m: op.Cast(m.a, to=onnx.TensorProto.INT64))
    text = """
    <ir_version: 8, opset_import: ["": 17]>
    g (float[2] x) => (float[2] y) { y = Relu (x) }"""
    model = model_from_text(text)
    out, report = graphopt.optimize(model, rules=[bad])
    assert op_types(out) == ["Relu"]
    stats = report.rules["to_int"]
    assert stats.rollbacks == 1 and stats.rewrites == 0
    assert "would change type" in stats.rollback_reasons[0]
    assert "rolled back (to_int)" in report.format_table()


def test_rewrite_using_an_undefined_tensor_is_rolled_back():
    bad = rule("dangling", op.Relu(a), lambda m: op.Sigmoid("no_such_tensor"))
    text = """
    <ir_version: 8, opset_import: ["": 17]>
    g (float[2] x) => (float[2] y) { y = Relu (x) }"""
    out, report = graphopt.optimize(model_from_text(text), rules=[bad])
    assert op_types(out) == ["Relu"]
    assert "not defined" in report.rules["dangling"].rollback_reasons[0]


@pytest.mark.parametrize("reads", ["y", "later"])
def test_rewrite_reading_its_own_output_or_a_later_tensor_is_rejected_unchanged(reads):
    bad = rule("cycle", op.Relu(a), lambda m: op.Sigmoid(reads))
    text = """
    <ir_version: 8, opset_import: ["": 17]>
    g (float[2] x) => (float[2] y, float[2] later) {
        y = Relu (x)
        later = Identity (x)
    }"""
    model = model_from_text(text)
    out, report = graphopt.optimize(model, rules=[bad])
    assert out.graph.node == model.graph.node
    assert "used before it is produced" in report.rules["cycle"].rollback_reasons[0]
    assert report.warnings == []  # caught by the rewrite's own check, not the final one


def test_new_domain_gets_an_opset_import():
    r = rule("to_ms", op.MatMul(a, b), lambda m: op.ms.FusedMatMul(m.a, m.b, alpha=1.0))
    out, _ = graphopt.optimize(model_from_text(CHAIN), rules=[r])
    domains = {o.domain: o.version for o in out.opset_import}
    assert domains.get("com.microsoft") == 1
    untouched, _ = graphopt.optimize(model_from_text(CHAIN), rules=[DOUBLE_TRANSPOSE])
    assert "com.microsoft" not in {o.domain for o in untouched.opset_import}


def test_graph_output_replaced_by_existing_tensor_keeps_its_name():
    text = """
    <ir_version: 8, opset_import: ["": 17]>
    g (float[2] x) => (float[2] y) { y = Identity (x) }"""
    r = rule("drop_identity", op.Identity(a), lambda m: m.a)
    out, _ = graphopt.optimize(model_from_text(text), rules=[r])
    assert out.graph.output[0].name == "y"
    assert [n.output[0] for n in out.graph.node] == ["y"]


def test_sticky_backward_pass_attribute_follows_the_replaced_nodes():
    model = model_from_text(CHAIN)
    for node in model.graph.node:
        node.attribute.append(onnx.helper.make_attribute("__backwardpass", 1))
    r = rule("to_ms", op.MatMul(a, b), lambda m: op.ms.FusedMatMul(m.a, m.b))
    out, _ = graphopt.optimize(model, rules=[r])
    fused = [n for n in out.graph.node if n.op_type == "FusedMatMul"][0]
    assert graphopt.ir.get_attr(fused, "__backwardpass") == 1
    plain = model_from_text(CHAIN)
    out, _ = graphopt.optimize(plain, rules=[r])
    fused = [n for n in out.graph.node if n.op_type == "FusedMatMul"][0]
    assert graphopt.ir.get_attr(fused, "__backwardpass") is None


def test_rule_cycle_is_bounded_with_a_warning():
    there = rule("relu_to_sigmoid", op.Relu(a), lambda m: op.Sigmoid(m.a))
    back = rule("sigmoid_to_relu", op.Sigmoid(a), lambda m: op.Relu(m.a))
    text = """
    <ir_version: 8, opset_import: ["": 17]>
    g (float[2] x) => (float[2] y) { y = Relu (x) }"""
    _, report = graphopt.optimize(model_from_text(text), rules=[there, back])
    assert any("budget" in w for w in report.warnings)


def test_passes_run_with_the_same_metadata_and_report():
    calls = []

    def count(graph, report):
        calls.append(len(graph.nodes))
        return 0
    p = Pass(name="counter", description="counts", run=count)
    _, report = graphopt.optimize(model_from_text(CHAIN), rules=[p])
    assert calls == [5]
    assert report.rules["counter"].kind == "pass"


def test_one_of_tries_alternatives():
    r = rule("either", one_of(op.Relu(a), op.MatMul(a, b)), lambda m: None)
    _, report = graphopt.optimize(model_from_text(CHAIN), rules=[r])
    assert report.rules["either"].candidates == 1


def test_rule_selection_by_level_enable_disable_provider():
    names = {r.name for r in graphopt.select_rules(level=1)}
    assert "gather_slice_to_split" in names and "matmul_transpose_to_fused_matmul" not in names
    names = {r.name for r in graphopt.select_rules(level=1,
                                                   enable=["matmul_transpose_to_fused_matmul"])}
    assert "matmul_transpose_to_fused_matmul" in names
    names = {r.name for r in graphopt.select_rules(disable=["gather_slice_to_split"])}
    assert "gather_slice_to_split" not in names
    with pytest.raises(GraphoptError, match="unknown rule 'nope'"):
        graphopt.select_rules(enable=["nope"])
    with pytest.raises(GraphoptError, match="unknown provider"):
        graphopt.select_rules(provider="tpu")


def test_registered_user_rule_is_selectable_by_name():
    r = rule("user_rule_for_test", op.Relu(a), lambda m: None)
    graphopt.register(r)
    assert "user_rule_for_test" in graphopt.all_rules()
    assert [x.name for x in graphopt.select_rules(["user_rule_for_test"])] == ["user_rule_for_test"]


def test_opset_gate_skips_rules_for_old_models():
    seen = []
    r = rule("new_only", op.MatMul(a, b), lambda m: seen.append(1), min_opset={"": 18})
    graphopt.optimize(model_from_text(CHAIN), rules=[r])
    assert seen == []


@pytest.mark.parametrize("explain", [False, True])
def test_pattern_on_an_output_the_producer_does_not_have_is_a_miss(explain):
    """A pattern wanting output 1 of a Split meets a Split with one output: a miss (it
    used to raise IndexError in both matchers)."""
    second = rule("second_split_output", op.Relu(op.Split(a, _outputs=2)[1]),
                  lambda m: op.Sigmoid(m.a))
    model = model_from_text("""
        <ir_version: 8, opset_import: ["" : 18]>
        g (float[4] x) => (float[4] y) {
          s = Split <axis = 0, num_outputs = 1> (x)
          y = Relu(s)
        }""")
    out, report = graphopt.optimize(model, rules=[second],
                                    explain=["second_split_output"] if explain else ())
    assert op_types(out) == ["Split", "Relu"]
    if explain:
        assert "is not output 1 of Split" in report.format_explain("second_split_output")

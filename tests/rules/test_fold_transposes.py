"""fold_transposes: Transpose(Transpose(x, p), q) -> Transpose(x, p[q]) or x."""
from __future__ import annotations

import itertools

import onnx
import pytest
from onnx import helper
from support.models import (
    assert_no_change,
    assert_same_outputs,
    assert_second_run_changes_nothing,
    model_from_text,
    op_types,
)

import graphopt

RULE = "fold_transposes"


def run(model, **kw):
    return graphopt.optimize(model, [RULE], **kw)


def two_transposes(p, q, *, extra="", outputs=""):
    shape = [2, 3, 4]
    mid = [shape[i] for i in p]
    final = [mid[i] for i in q]
    return model_from_text(f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2,3,4] x) => (float[{",".join(map(str, final))}] y{outputs}) {{
          t = Transpose <perm = {list(p)}> (x)
          u = Transpose <perm = {list(q)}> (t)
          y = Relu(u)
          {extra}
        }}""")


PERMS = list(itertools.permutations(range(3)))


@pytest.mark.parametrize("p,q", [(p, q) for p in PERMS for q in PERMS
                                 if list(p) != [0, 1, 2] and list(q) != [0, 1, 2]])
def test_two_transposes_become_one_or_none(p, q):
    before = two_transposes(p, q)
    out, report = run(before)
    composed = [p[i] for i in q]
    if composed == [0, 1, 2]:
        assert op_types(out) == ["Relu"]
        assert list(out.graph.node[0].input) == ["x"]
    else:
        assert op_types(out) == ["Transpose", "Relu"]
        transpose = out.graph.node[0]
        assert list(transpose.input) == ["x"]
        assert helper.get_attribute_value(transpose.attribute[0]) == composed
    assert report.rules[RULE].rewrites == 1
    onnx.checker.check_model(out, full_check=True)
    assert_same_outputs(before, out, atol=0, rtol=0)
    assert_second_run_changes_nothing(out, [RULE])


def test_three_in_a_row_fold_to_one():
    before = model_from_text("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2,3,4] x) => (float[2,4,3] y) {
          a = Transpose <perm = [1, 0, 2]> (x)
          b = Transpose <perm = [0, 2, 1]> (a)
          c = Transpose <perm = [2, 1, 0]> (b)
          y = Relu(c)
        }""")
    out, _ = run(before)
    assert op_types(out) == ["Transpose", "Relu"]
    assert_same_outputs(before, out, atol=0, rtol=0)


def test_inner_transpose_with_another_consumer_stays():
    before = two_transposes([1, 0, 2], [0, 2, 1], extra="r = Neg(t)", outputs=", float[3,2,4] r")
    out, _ = run(before)
    assert op_types(out) == ["Transpose", "Transpose", "Relu", "Neg"]
    (neg,) = [n for n in out.graph.node if n.op_type == "Neg"]
    assert list(neg.input) == ["t"]
    assert all(list(n.input) == ["x"] for n in out.graph.node if n.op_type == "Transpose")
    assert_same_outputs(before, out, atol=0, rtol=0)


def test_cancelling_pair_whose_output_is_a_graph_output_keeps_the_name():
    before = model_from_text("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2,3,4] x) => (float[2,3,4] u) {
          t = Transpose <perm = [1, 0, 2]> (x)
          u = Transpose <perm = [1, 0, 2]> (t)
        }""")
    out, _ = run(before)
    assert [o.name for o in out.graph.output] == ["u"]
    assert op_types(out) == ["Identity"]
    assert list(out.graph.node[0].input) == ["x"]
    onnx.checker.check_model(out, full_check=True)
    assert_same_outputs(before, out, atol=0, rtol=0)
    assert_no_change(out, [RULE])


def test_transpose_without_perm_is_left_alone():
    before = model_from_text("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2,3,4] x) => (float[4,3,2] y) {
          t = Transpose (x)
          u = Transpose <perm = [1, 0, 2]> (t)
          y = Transpose <perm = [1, 0, 2]> (u)
        }""")
    out, report = run(before, explain=[RULE])
    # u, y cancel; the perm-less inner one stays and is explained
    assert op_types(out) == ["Transpose", "Identity"]
    assert "a Transpose has no perm" in report.format_explain(RULE)
    assert_same_outputs(before, out, atol=0, rtol=0)

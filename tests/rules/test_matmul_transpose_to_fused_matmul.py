"""matmul_transpose_to_fused_matmul: Transposes FusedMatMul can express."""
from __future__ import annotations

import itertools

import numpy as np
import onnx
import pytest
from onnx import helper
from support.models import (
    MQA_FIXTURES,
    assert_declined,
    assert_no_change,
    assert_same_outputs,
    assert_second_run_changes_nothing,
    fixture_feeds,
    fixture_path,
    fused,
    fused_attrs,
    model_from_text,
    op_types,
    ort_optimized,
    run_ort,
)

import graphopt

RULE = "matmul_transpose_to_fused_matmul"
def run(model, rules=(RULE,), **kw):
    return graphopt.optimize(model, list(rules), **kw)


# ---- every expressible Transpose, on A, on B, on both --------------------------------
def _inverse(perm):
    inv = [0] * len(perm)
    for i, p in enumerate(perm):
        inv[p] = i
    return inv


def _perms(rank):
    perms = {"trans": list(range(rank - 2)) + [rank - 1, rank - 2]}
    if rank >= 3:
        perms["batch"] = list(range(1, rank - 1)) + [0, rank - 1]          # [1..r-2, 0, r-1]
        perms["batch_trans"] = list(range(1, rank - 1)) + [rank - 1, 0]    # [1..r-2, r-1, 0]
    return perms


FLAGS = {None: (0, 0), "trans": (1, 0), "batch": (0, 1), "batch_trans": (1, 1)}


def _cases():
    for rank in (2, 3, 4):
        kinds = [None, *_perms(rank)]
        for ka, kb in itertools.product(kinds, repeat=2):
            if ka or kb:
                yield pytest.param(rank, ka, kb, id=f"r{rank}-A:{ka}-B:{kb}")


def transposed_matmul(rank, kind_a, kind_b, dtype=onnx.TensorProto.FLOAT):
    batch = [2, 3][:rank - 2]
    logical_a, logical_b = batch + [5, 7], batch + [7, 4]
    node_list, a_in, b_in = [], "a", "b"
    shape_a, shape_b = logical_a, logical_b
    if kind_a:
        perm = _perms(rank)[kind_a]
        shape_a = [logical_a[i] for i in _inverse(perm)]
        node_list.append(helper.make_node("Transpose", ["a"], ["ta"], perm=perm, name="TA"))
        a_in = "ta"
    if kind_b:
        perm = _perms(rank)[kind_b]
        shape_b = [logical_b[i] for i in _inverse(perm)]
        node_list.append(helper.make_node("Transpose", ["b"], ["tb"], perm=perm, name="TB"))
        b_in = "tb"
    node_list.append(helper.make_node("MatMul", [a_in, b_in], ["y"], name="MM"))
    graph = helper.make_graph(node_list, "g", [helper.make_tensor_value_info("a", dtype, shape_a),
                                               helper.make_tensor_value_info("b", dtype, shape_b)],
                              [helper.make_tensor_value_info("y", dtype, batch + [5, 4])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model, full_check=True)
    return model


@pytest.mark.parametrize("rank,kind_a,kind_b", list(_cases()))
def test_transposes_fold_into_flags(rank, kind_a, kind_b, tmp_path):
    model = transposed_matmul(rank, kind_a, kind_b)
    out, report = run(model)
    assert op_types(out) == ["FusedMatMul"]
    (node,) = fused(out)
    assert node.domain == "com.microsoft"
    assert list(node.input) == ["a", "b"] and list(node.output) == ["y"]
    (ta, tba), (tb, tbb) = FLAGS[kind_a], FLAGS[kind_b]
    assert fused_attrs(node) == {"alpha": 1.0, "transA": ta, "transB": tb,
                                 "transBatchA": tba, "transBatchB": tbb}
    assert report.rules[RULE].rollbacks == 0
    assert any(o.domain == "com.microsoft" for o in out.opset_import)
    # numerics: onnxruntime runs com.microsoft FusedMatMul on CPU
    assert_same_outputs(model, out, rtol=1e-5, atol=1e-5)
    # parity: onnxruntime's own MatMulTransposeFusion makes the same node
    (theirs,) = fused(ort_optimized(model, tmp_path))
    assert list(theirs.input) == list(node.input)
    assert fused_attrs(theirs) == fused_attrs(node)
    assert_second_run_changes_nothing(out, [RULE])


def test_fusedmatmul_base_absorbs_another_transpose():
    model = model_from_text("""
        <ir_version: 8, opset_import: ["" : 17, "com.microsoft" : 1]>
        g (float[2,7,5] a, float[2,4,7] b) => (float[2,5,4] y) {
          ta = Transpose <perm = [0, 2, 1]> (a)
          y = com.microsoft.FusedMatMul <alpha = 0.5, transB = 1> (ta, b)
        }""")
    out, report = run(model)
    assert op_types(out) == ["FusedMatMul"]
    (node,) = fused(out)
    assert list(node.input) == ["a", "b"]
    assert fused_attrs(node) == {"alpha": 0.5, "transA": 1, "transB": 1, "transBatchA": 0,
                                 "transBatchB": 0}
    assert_same_outputs(model, out, rtol=1e-5, atol=1e-5)
    assert_second_run_changes_nothing(out, [RULE])


def test_transpose_cancelling_a_flag_clears_it():
    model = model_from_text("""
        <ir_version: 8, opset_import: ["" : 17, "com.microsoft" : 1]>
        g (float[2,5,7] a, float[7,2,4] b) => (float[2,5,4] y) {
          ta = Transpose <perm = [0, 2, 1]> (a)
          tb = Transpose <perm = [1, 0, 2]> (b)
          y = com.microsoft.FusedMatMul <transA = 1> (ta, tb)
        }""")
    out, _ = run(model)
    (node,) = fused(out)
    assert op_types(out) == ["FusedMatMul"]
    assert fused_attrs(node) == {"alpha": 1.0, "transA": 0, "transB": 0, "transBatchA": 0,
                                 "transBatchB": 1}
    assert_same_outputs(model, out, rtol=1e-5, atol=1e-5)


def test_transpose_with_another_consumer_stays():
    model = model_from_text("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[5,7] a, float[4,7] b) => (float[5,4] y, float[7,4] r) {
          tb = Transpose <perm = [1, 0]> (b)
          y = MatMul(a, tb)
          r = Relu(tb)
        }""")
    out, report = run(model)
    assert op_types(out) == ["Transpose", "FusedMatMul", "Relu"]
    (node,) = fused(out)
    assert list(node.input) == ["a", "b"] and fused_attrs(node)["transB"] == 1
    (relu,) = [n for n in out.graph.node if n.op_type == "Relu"]
    assert list(relu.input) == ["tb"]
    assert_same_outputs(model, out, rtol=1e-5, atol=1e-5)
    assert_second_run_changes_nothing(out, [RULE])


def test_transpose_that_is_a_graph_output_stays():
    model = model_from_text("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[7,5] a, float[7,4] b) => (float[5,4] y, float[5,7] ta) {
          ta = Transpose <perm = [1, 0]> (a)
          y = MatMul(ta, b)
        }""")
    out, _ = run(model)
    assert sorted(op_types(out)) == ["FusedMatMul", "Transpose"]
    assert [o.name for o in out.graph.output] == ["y", "ta"]
    (t,) = [n for n in out.graph.node if n.op_type == "Transpose"]
    assert list(t.output) == ["ta"]
    assert fused_attrs(fused(out)[0])["transA"] == 1
    assert_same_outputs(model, out, rtol=1e-5, atol=1e-5)


def test_int32_matmul_is_not_fused():
    model = transposed_matmul(3, None, "trans", dtype=onnx.TensorProto.INT32)
    assert_declined(model, RULE, "FusedMatMul needs float inputs")


@pytest.mark.parametrize("perm", [[2, 0, 1], [2, 1, 0]])
def test_non_expressible_perm_is_not_fused(perm):
    shape = [[3, 4, 5][i] for i in _inverse(perm)]
    model = model_from_text(f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[{",".join(map(str, shape))}] a, float[3,5,6] b) => (float[3,4,6] y) {{
          ta = Transpose <perm = {perm}> (a)
          y = MatMul(ta, b)
        }}""")
    assert_declined(model, RULE, f"Transpose perm {perm} is not expressible by FusedMatMul flags")


@pytest.mark.parametrize("side", ["a", "b"])
def test_transpose_without_perm_is_not_fused(side):
    """A Transpose without perm reverses all dims: the rule declines it rather than work
    out the rank."""
    model = model_from_text(f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[4,4] a, float[4,4] b) => (float[4,4] y) {{
          t = Transpose ({side})
          y = MatMul({"t, b" if side == "a" else "a, t"})
        }}""")
    assert_declined(model, RULE, "Transpose has no perm")


def test_attention_perm_0213_is_not_fused():
    model = model_from_text("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2,5,3,7] a, float[2,3,7,4] b) => (float[2,3,5,4] y) {
          ta = Transpose <perm = [0, 2, 1, 3]> (a)
          y = MatMul(ta, b)
        }""")
    assert_declined(model, RULE, "not expressible")


def test_transbatch_with_inputs_of_different_rank_is_not_fused():
    """onnxruntime's FusedMatMul rejects transBatch unless both inputs have the same rank
    >= 3, so MatMul(Transpose(a3d, [1,0,2]), W2d) must stay (it failed at run time)."""
    model = model_from_text("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[5,2,7] a, float[7,4] w) => (float[2,5,4] y) {
          t = Transpose <perm = [1, 0, 2]> (a)
          y = MatMul(t, w)
        }""")
    assert_declined(model, RULE, "transBatch needs both inputs of the same rank >= 3 (ranks 3, 2)")


def test_plain_trans_with_inputs_of_different_rank_is_fused():
    model = model_from_text("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2,7,5] a, float[7,4] w) => (float[2,5,4] y) {
          t = Transpose <perm = [0, 2, 1]> (a)
          y = MatMul(t, w)
        }""")
    out, _ = run(model)
    assert op_types(out) == ["FusedMatMul"]
    assert fused_attrs(fused(out)[0])["transA"] == 1
    assert_same_outputs(model, out, rtol=1e-5, atol=1e-5)


def test_matmul_without_transpose_is_not_a_match():
    model = model_from_text("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[5,7] a, float[7,4] b) => (float[5,4] y) {
          y = MatMul(a, b)
        }""")
    report = assert_no_change(model, [RULE])
    assert report.rules[RULE].rewrites == 0


def test_not_run_at_level_1():
    model = transposed_matmul(2, None, "trans")
    out, report = graphopt.optimize(model, level=1)
    assert "FusedMatMul" not in op_types(out)
    assert RULE not in report.rules


# ---- parity with onnxruntime on the fixtures ------------------------------------------
@pytest.mark.parametrize("name", MQA_FIXTURES)
def test_every_onnxruntime_fusedmatmul_appears_in_ours(name, tmp_path):
    path = fixture_path(name + ".onnx")
    theirs = fused(ort_optimized(path, tmp_path))
    assert theirs, "onnxruntime made no FusedMatMul: nothing to compare"
    out, _ = graphopt.optimize(path)
    ours = {(tuple(n.input), tuple(n.output)): fused_attrs(n) for n in fused(out)}
    for node in theirs:
        key = (tuple(node.input), tuple(node.output))
        assert key in ours, f"onnxruntime's {key} missing; ours: {sorted(ours)}"
        assert ours[key] == pytest.approx(fused_attrs(node))
    assert all(n.domain == "com.microsoft" for n in fused(out))

    def matmul_like(model):  # the README's claim: never more of these than onnxruntime
        return sum(n.op_type in ("Transpose", "MatMul", "FusedMatMul", "Gemm")
                   for n in model.graph.node)

    assert matmul_like(out) <= matmul_like(ort_optimized(path, tmp_path))
    feeds = fixture_feeds(name + ".onnx")
    np.testing.assert_allclose(run_ort(out, feeds)[0], run_ort(path, feeds)[0],
                               rtol=1e-5, atol=1e-5)


def test_b_is_absorbed_when_a_cannot_be():
    # GPT-BigCode's attention: q Transposed [0, 2, 1, 3] (not a FusedMatMul flag), k^T as
    # Transpose [0, 1, 3, 2] (transB): the second goes even though the first must stay.
    model = model_from_text("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2,5,3,4] q, float[2,3,5,4] k) => (float[2,3,5,5] y) {
          qt = Transpose <perm = [0, 2, 1, 3]> (q)
          kt = Transpose <perm = [0, 1, 3, 2]> (k)
          y = MatMul(qt, kt)
        }""")
    out, report = run(model)
    assert op_types(out) == ["Transpose", "FusedMatMul"]
    (node,) = fused(out)
    assert list(node.input) == ["qt", "k"] and fused_attrs(node)["transB"] == 1
    assert report.rules[RULE].rewrites == 1
    assert_same_outputs(model, out)
    assert_second_run_changes_nothing(out, [RULE])

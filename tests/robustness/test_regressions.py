"""Every failure the property tests found, as a fixed small graph named after the bug.

Fixed bugs pass; open ones are strict xfails naming the file and the fix (the lead fixes
graphopt/*.py); when one is fixed its xfail turns into a failure, so it gets unmarked."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import graphopt
from graphopt.dsl import Pass
from graphopt.errors import GraphoptError

from .known_bugs import fan_out_model, stale_marks_model
from .oracle import KnownBugHit, check_optimize, run_executor, run_ort, strict_check

MS = "com.microsoft"
F = TensorProto.FLOAT
n = helper.make_node


def _model(nodes, inputs, outputs, inits=(), opset=17, value_info=(), ms=False):
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(inits),
                              value_info=list(value_info))
    opsets = [helper.make_opsetid("", opset)] + ([helper.make_opsetid(MS, 1)] if ms else [])
    model = helper.make_model(graph, opset_imports=opsets)
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    return model


def _vi(name, shape, elem=F):
    return helper.make_tensor_value_info(name, elem, shape)


def _init(name, value):
    return numpy_helper.from_array(np.asarray(value), name)


# ---- fixed in rules/ ----------------------------------------------------------------


def test_scale_fusion_keeps_rank_when_a_rank1_scale_broadcasts_a_rank0_tensor():
    """MatMul(c * s, y) with c a rank-0 tensor and s a [1] constant: c * s has shape [1]. The
    commutative matcher bound a=c, scale=s and made FusedMatMul(c, y) with a rank-0 input,
    which onnxruntime refuses ("Input tensors of wrong rank (0)"). ONNX inference did not
    notice because it does not know FusedMatMul. Fixed in rules/matmul_scale_to_fused_matmul.py
    (_scale_keeps_shape)."""
    model = _model(
        [n("Mul", ["c", "s"], ["cs"]), n("MatMul", ["cs", "y"], ["out"])],
        [_vi("c", []), _vi("y", [1, 2])], [_vi("out", [2])],
        inits=[_init("s", np.array([0.5], np.float32))])
    optimized, _ = check_optimize(model)
    assert all(len(node.input) == 0 or node.input[0] != "c" or node.op_type != "FusedMatMul"
               for node in optimized.graph.node)


def test_scale_fusion_keeps_rank_of_a_rank0_product():
    """Mul(MatMul(a[k], b[k]), s[1]): the product is rank 0, the Mul output rank 1."""
    model = _model(
        [n("MatMul", ["a", "b"], ["p"]), n("Mul", ["p", "s"], ["out"])],
        [_vi("a", [3]), _vi("b", [3])], [_vi("out", [1])],
        inits=[_init("s", np.array([2.0], np.float32))])
    check_optimize(model)


def test_transpose_fusion_does_not_make_transA_with_a_rank1_b():
    """MatMul(Transpose(x), b[k]) -> FusedMatMul(x, b, transA=1): onnxruntime's CPU
    FusedMatMul computes wrong values when B is rank 1 (and transA is set). Fixed in
    rules/matmul_transpose_to_fused_matmul.py (declines that case)."""
    model = _model(
        [n("Transpose", ["x"], ["xt"], perm=[0, 1, 3, 2]), n("MatMul", ["xt", "b"], ["out"])],
        [_vi("x", [1, 2, 2, 4]), _vi("b", [2])], [_vi("out", [1, 2, 4])])
    check_optimize(model)


def test_onnxruntime_fused_matmul_transA_with_rank1_b_is_still_wrong():
    """Why the rule declines: if this starts passing, onnxruntime fixed it (drop the check)."""
    model = _model([n("FusedMatMul", ["a", "b"], ["y"], domain=MS, transA=1)],
                   [_vi("a", [4, 2]), _vi("b", [4])], [_vi("y", [2])], ms=True)
    rng = np.random.default_rng(0)
    feeds = {"a": rng.standard_normal((4, 2)).astype(np.float32),
             "b": rng.standard_normal(4).astype(np.float32)}
    expected = feeds["a"].T @ feeds["b"]
    np.testing.assert_allclose(run_executor(model, feeds)["y"], expected, rtol=1e-5)
    assert not np.allclose(run_ort(model, feeds)["y"], expected, rtol=1e-3)


def test_fold_constants_keeps_pre_opset13_softmax_semantics():
    """Softmax(constant[1,4,5], axis=-2) at opset 12 coerces to 2-D (softmax over 20 values);
    onnx.reference evaluates it with opset-13 semantics (over 4 values), so fold_constants
    folded wrong numbers. Fixed in rules/fold_constants.py (REFERENCE_WRONG_BEFORE_13)."""
    value = np.random.default_rng(0).standard_normal((1, 4, 5)).astype(np.float32)
    model = _model(
        [n("Softmax", ["k"], ["sm"], axis=-2), n("Add", ["sm", "x"], ["out"])],
        [_vi("x", [1, 4, 5])], [_vi("out", [1, 4, 5])], inits=[_init("k", value)], opset=12)
    check_optimize(model)


def test_mark_backward_pass_leaves_constant_nodes_alone():
    """A Constant node after YieldOp got __backwardpass=1; ONNX shape inference then read the
    Constant's value wrongly (it took the int 1 as the Squeeze axes), the whole-model check
    failed, the careful replay rolled the whole pass back and NO node was marked (and a second
    optimize raised InferenceError). Fixed in rules/mark_backward_pass.py (skips Constant)."""
    model = _model(
        [n("Softmax", ["x"], ["y"], axis=-1),
         n("YieldOp", ["y"], ["gy"], name="yield", domain=MS, full_shape_outputs=[0]),
         n("Constant", [], ["axes"], name="bw_axes",
           value=numpy_helper.from_array(np.array([0], np.int64))),
         n("Squeeze", ["gy", "axes"], ["g"], name="bw_squeeze")],
        [_vi("x", [1, 3, 2])], [_vi("g", [3, 2])], ms=True,
        value_info=[_vi("gy", [1, 3, 2])])
    optimized, report = check_optimize(model)
    marks = {node.name: {a.name: a.i for a in node.attribute}.get("__backwardpass")
             for node in optimized.graph.node}
    assert marks["yield"] == 1 and marks["bw_squeeze"] == 1
    assert not report.warnings


# ---- open: graphopt/*.py (the lead fixes) -------------------------------------------


def test_fixpoint_when_a_level2_fusion_changes_what_feeds_yieldop():
    once, _ = graphopt.optimize(stale_marks_model())
    twice, _ = graphopt.optimize(once)
    assert twice.SerializeToString() == once.SerializeToString()


def _perm_breaker() -> Pass:
    """A pass whose change only the whole-model check can catch (a bad Transpose perm)."""

    def run(graph, report):
        for node_id in graph.nodes_of_type("Transpose"):
            perm = [a for a in graph.nodes[node_id].attribute if a.name == "perm"][0]
            if list(perm.ints) != [0, 0]:
                graph.set_attribute(node_id, helper.make_attribute("perm", [0, 0]))
                return 1
        return 0
    return Pass(name="perm_breaker", description="breaks Transpose perms", run=run, level=1)


def test_a_change_rolled_back_during_the_careful_replay_leaves_no_trace():
    model = _model([n("Transpose", ["x"], ["y"], perm=[1, 0])], [_vi("x", [2, 3])],
                   [_vi("y", [3, 2])])
    optimized, report = graphopt.optimize(model, [_perm_breaker()])
    strict_check(optimized)
    assert report.rules["perm_breaker"].rollbacks >= 1
    assert list(optimized.graph.node[0].attribute[0].ints) == [1, 0]


def contradicting_value_info_model() -> onnx.ModelProto:
    """Passes onnx.checker (what load checks) but not strict shape inference: a value_info
    that contradicts the graph; a rule fires elsewhere, so the final validation runs."""
    model = _model(
        [n("Relu", ["x"], ["r"]), n("Relu", ["r"], ["y1"]),
         n("Transpose", ["x"], ["t"], perm=[1, 0]), n("Transpose", ["t"], ["y2"], perm=[1, 0])],
        [_vi("x", [2, 3])], [_vi("y1", [2, 3]), _vi("y2", [2, 3])])
    model.graph.value_info.append(_vi("r", [7, 7]))
    return model


def test_input_that_fails_strict_inference_is_a_user_error_not_a_crash():
    """The input only has to pass onnx.checker to load; when the final check fails because
    the input itself fails strict shape inference, that is the user's error, said in one
    line (not a careful replay that can never succeed, not a traceback)."""
    with pytest.raises(GraphoptError, match="invalid ONNX model"):
        graphopt.optimize(contradicting_value_info_model())



def test_fixpoint_when_a_rewrite_frees_a_fan_out_tensor():
    model = fan_out_model()
    once, report = graphopt.optimize(model)
    assert "gather_slice_to_split" in report.fired
    try:
        check_optimize(model)
    except KnownBugHit as exc:
        raise AssertionError(str(exc)) from None


def _piece_of_a_computed_chunk_model() -> onnx.ModelProto:
    """Random graph failure_000 of the reliability report, reduced: ``y`` is chunked in three
    along axis 1 by Slices whose bounds are computed from ``Shape(y)``, and the last piece is
    cut whole along its axis 0 by a Slice and three Gathers. The chunk becomes a Split whose
    sizes are folded only later."""
    text = """
    <ir_version: 8, opset_import: ["" : 17]>
    chunked (float[4,3,5] x, float[5,5] w) => (float[4,1,5] a, float[4,1,5] b, float[1,5] c,
                                              float[1,5] d, float[1,1,5] e, float[1,1,5] f) {
        y = MatMul (x, w)
        shape = Shape (y)
        axis_index = Constant <value = int64 {-2}> ()
        length = Gather (shape, axis_index)
        three = Constant <value = int64 {3}> ()
        size = Div (length, three)
        zero = Constant <value = int64[1] {0}> ()
        two = Constant <value = int64 {2}> ()
        one_piece = Unsqueeze (size, zero)
        twice = Mul (size, two)
        two_pieces = Unsqueeze (twice, zero)
        thrice = Mul (size, three)
        three_pieces = Unsqueeze (thrice, zero)
        axes = Constant <value = int64[1] {-2}> ()
        a = Slice (y, zero, one_piece, axes)
        b = Slice (y, one_piece, two_pieces, axes)
        last = Slice (y, two_pieces, three_pieces, axes)
        minus_two = Constant <value = int32 {-2}> ()
        c = Gather (last, minus_two)
        one = Constant <value = int64 {1}> ()
        d = Gather <axis = -3> (last, one)
        starts = Constant <value = int64[1] {0}> ()
        ends = Constant <value = int64[1] {-3}> ()
        first_axis = Constant <value = int64[1] {-3}> ()
        e = Slice (last, starts, ends, first_axis)
        index_three = Constant <value = int32[1] {3}> ()
        f = Gather (last, index_three)
    }
    """
    model = onnx.parser.parse_model(text)
    onnx.checker.check_model(model, full_check=True)
    return model


def test_fixpoint_when_a_piece_of_a_split_gets_its_shape_only_after_folding():
    # The Split made from the chunk had outputs typed [?,?,?] (its sizes were computed
    # then); after folding, nothing re-inferred them, so the rule on the piece matched only
    # when the result was optimized again.
    model = _piece_of_a_computed_chunk_model()
    once, report = check_optimize(model)
    assert report.rules["gather_slice_to_split"].rewrites >= 1



# reliability report (1000 graphs, seed unset), failure_000, reduced by deleting outputs
# while the failure held: Slice(w0)'s result is computed from Shape(sym58); the rule on
# t111's two Gathers needs t111's shape, which the first whole-model inference left
# unknown and folding made exact.
FOLDED_AFTER_INFERENCE = """
    <
       ir_version: 8,
       opset_import: ["" : 14, "com.microsoft" : 1]
    >
    random (float[1,1,4] sym58) => (float[1,1,1] t52, float[1,1] t117, float[1,1,1] t120)
       <float[1,1,4] w0 =  {0.79232204,0.65763736,0.23038992,-0.9051246},
        int64[1] sizes7 =  {4}, int64[1] starts15 =  {1}, int64 dim28 =  {-3},
        int64[1] zero34 =  {0}, int64 squeeze_axes =  {2}, int64 i42 =  {3},
        int64[1] axes47 =  {0}, int64 dim60 =  {2}, int64[1] zero66 =  {0},
        int64[1] axes75 =  {-1}, int32[1] idx119 =  {-1}>
    {
       [Transpose_2] t1 = Transpose <perm: ints = [2, 0, 1]> (w0)
       [Split_9] t8 = Split <axis: int = -3> (t1, sizes7)
       [Identity_14] t13 = Identity (t8)
       [Constant_17] ends16 = Constant <value: tensor = int64[1] ends16 {9223372036854775807}> ()
       [Constant_19] axes18 = Constant <value: tensor = int64[1] axes18 {-3}> ()
       [Slice_21] t20 = Slice (t13, starts15, ends16, axes18)
       [Shape_27] t26 = Shape (t20)
       [Gather_30] t29 = Gather (t26, dim28)
       [Constant_32] k31 = Constant <value: tensor = int64 k31 {3}> ()
       t33 = Div (t29, k31)
       [Mul_40] t39 = Mul (t33, squeeze_axes)
       t41 = Unsqueeze (t39, zero34)
       [Mul_44] t43 = Mul (t33, i42)
       [Unsqueeze_46] t45 = Unsqueeze (t43, zero34)
       [Slice_53] t52 = Slice (t20, t41, t45, axes47)
       [gather_indices] t59 = Shape (sym58)
       [Gather_62] t61 = Gather (t59, dim60)
       [Constant_64] k63 = Constant <value: tensor = int64 k63 {2}> ()
       [Div_65] const = Div (t61, k63)
       [Constant_68] i67 = Constant <value: tensor = int64 i67 {1}> ()
       [Split] t69 = Mul (const, i67)
       t70 = Unsqueeze (t69, zero66)
       [Slice_77] t76 = Slice (w0, zero66, t70, axes75)
       [Transpose_82] t81 = Transpose <perm: ints = [2, 1, 0]> (t76)
       [Transpose_112] t111 = Transpose <perm: ints = [2, 0, 1]> (t81)
       [Constant_116] idx115 = Constant <value: tensor = int64 idx115 {-2}> ()
       [Gather_118] t117 = Gather <axis: int = 1> (t111, idx115)
       [Gather_121] t120 = Gather <axis: int = -2> (t111, idx119)
    }
"""


def test_fixpoint_when_a_folded_tensor_had_a_type_inferred_before_the_fold():
    model = onnx.parser.parse_model(FOLDED_AFTER_INFERENCE)
    once, report = check_optimize(model)  # optimizing ``once`` again changes nothing
    assert report.rules["gather_slice_to_split"].rewrites >= 1



# reliability report (1000 graphs), failure_000 of the second run, reduced: MatMul_47 reads
# a Transpose as A and, as B, the rank-1 product that matmul_scale_to_fused_matmul turns
# into a FusedMatMul. ONNX inference knows no com.microsoft op, so optimizing the result
# again saw B's rank as unknown and fused with transA over a rank-1 B, the case onnxruntime
# computes wrongly; the first run had refused it.
RANK_AFTER_A_FUSED_MATMUL = """
    <
       ir_version: 8,
       opset_import: ["" : 12]
    >
    random (float[5,5] squeeze_axes, float[5] in39) => (float[1,1,5] t83, float[5] t46)
       <float s43 =  {0}, int64[1,1,1] nd82 =  {4}>
    {
       [Transpose_33] t32 = Transpose <perm: ints = [1, 0]> (squeeze_axes)
       [Split_38] t37 = Split <axis: int = -1, split: ints = [5]> (t32)
       [MatMul_41] t40 = MatMul (t37, in39)
       t42 = Transpose <perm: ints = [1, 0]> (t37)
       [Mul_45] t44 = Mul (t40, s43)
       [MatMul_47] t46 = MatMul (t42, t44)
       [Transpose_81] t80 = Transpose <perm: ints = [1, 0]> (t42)
       [GatherND_84] t83 = GatherND (t80, nd82)
    }
"""


@pytest.mark.parametrize("b_is_an_output", [False, True])
def test_fixpoint_when_a_rank_guard_reads_a_fused_matmul_output(b_is_an_output):
    model = onnx.parser.parse_model(RANK_AFTER_A_FUSED_MATMUL)
    if b_is_an_output:  # a graph output's declared shape is hidden from inference
        model.graph.output.append(helper.make_tensor_value_info("t44", F, [5]))
    once, report = check_optimize(model)  # optimizing ``once`` again changes nothing
    assert "matmul_scale_to_fused_matmul" in report.fired
    assert report.rules["matmul_transpose_to_fused_matmul"].rewrites == 0


def test_inference_types_fused_matmul_outputs_from_its_flags():
    from graphopt.ir import Model

    nodes = [n("FusedMatMul", ["a", "b"], ["y"], domain=MS, transA=1, transBatchB=1),
             n("Relu", ["y"], ["z"])]
    model = _model(nodes, [_vi("a", [2, 7, 3]), _vi("b", [7, 2, 5])], [_vi("z", [2, 3, 5])],
                   ms=True)
    found = Model(model).inferred_types()
    assert [d.dim_value for d in found["y"].tensor_type.shape.dim] == [2, 3, 5]
    assert [d.dim_value for d in found["z"].tensor_type.shape.dim] == [2, 3, 5]


def test_a_declared_tensor_folded_after_inference_has_its_values_shape():
    # reliability report, a later run (6 of 1000 not a fixpoint): ``piece`` is declared in
    # value_info and computed from a bound inference cannot propagate (ReduceMax), so the
    # first whole-model inference calls its shape [?, ?]; once fold_constants made it an
    # initializer, checking the declaration against that stale inference replaced its exact
    # type, and the Split fusion on its two readers waited for a second optimize.
    from graphopt.ir import Model

    nodes = [n("ReduceMax", ["one"], ["end"], keepdims=1),
             n("Slice", ["w", "zero", "end", "axis0"], ["piece"]),
             n("Gather", ["piece", "first"], ["a"], axis=1),
             n("Slice", ["piece", "one", "big", "last_axis"], ["b"])]
    inits = [_init("w", np.arange(12, dtype=np.float32).reshape(3, 4)),
             _init("one", np.array([1], np.int64)), _init("zero", np.array([0], np.int64)),
             _init("axis0", np.array([0], np.int64)), _init("first", np.array(0, np.int64)),
             _init("big", np.array([2**31 - 1], np.int64)),
             _init("last_axis", np.array([-1], np.int64))]
    model = _model(nodes, [_vi("x", [1])], [_vi("a", [1]), _vi("b", [1, 3])], inits,
                   value_info=[_vi("piece", [1, 4])])
    graph = Model(model).graph
    assert graph.static_shape("end") is not None   # whole-model inference has run
    graph.add_initializer(numpy_helper.from_array(np.zeros((1, 4), np.float32), "piece"))
    assert graph.static_shape("piece") == [1, 4]

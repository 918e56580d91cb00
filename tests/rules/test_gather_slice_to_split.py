"""gather_slice_to_split: ONNX Runtime's GatherSliceToSplitFusion, in its current form."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper
from support.models import (
    MQA_FIXTURES,
    assert_no_change,
    assert_same_outputs,
    assert_second_run_changes_nothing,
    fixture_feeds,
    fixture_path,
    model_from_text,
    op_types,
    overlapping_slices_model,
    run_ort,
)

import graphopt

RULE = "gather_slice_to_split"
INT64_MAX = 9223372036854775807


def build(body: str, inputs: str = "float[2,6,4] x", outputs: str = "", opset: int = 17,
          inits: str = "") -> onnx.ModelProto:
    return model_from_text(f"""
        <ir_version: 8, opset_import: ["" : {opset}]>
        g ({inputs}) => ({outputs}) {inits}
        {{
        {body}
        }}""")


def run(model, rules=(RULE,), **kw):
    return graphopt.optimize(model, list(rules), **kw)


def nodes(model, op_type):
    return [n for n in model.graph.node if n.op_type == op_type]


def init_value(model, name):
    for t in model.graph.initializer:
        if t.name == name:
            return numpy_helper.to_array(t)
    for n in model.graph.node:
        if n.op_type == "Constant" and n.output[0] == name:
            return numpy_helper.to_array(n.attribute[0].t)
    raise KeyError(name)


def split_sizes(model, split) -> list[int]:
    return init_value(model, split.input[1]).tolist()


def attr(node, name, default=None):
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def assert_unchanged(model, reason_part: str | None = None, opset_gated=False):
    report = assert_no_change(model, [RULE], explain=[RULE])
    if opset_gated:
        assert RULE not in report.rules or report.rules[RULE].candidates == 0
        return report
    stats = report.rules[RULE]
    assert stats.rewrites == 0 and stats.rollbacks == 0
    if reason_part is not None:
        text = report.format_explain(RULE)
        assert reason_part in text, text
    return report


# ---- the six Falcon MQA exports ----------------------------------------------------------
def _fused_tensor(model: onnx.ModelProto) -> str:
    """fused_qkv: the Reshape output that the q Slice reads."""
    producers = {o: n for n in model.graph.node for o in n.output}
    for n in model.graph.node:
        if n.op_type == "Slice" and producers.get(n.input[0]) is not None \
                and producers[n.input[0]].op_type == "Reshape":
            return n.input[0]
    raise AssertionError("no fused_qkv found")


@pytest.mark.parametrize("name", MQA_FIXTURES)
@pytest.mark.parametrize("level", [1, 2])
def test_mqa_fixture_becomes_one_split(name, level):
    path = fixture_path(name + ".onnx")
    original = onnx.load(path)
    fused = _fused_tensor(original)
    out, report = graphopt.optimize(path, level=level)
    onnx.checker.check_model(out, full_check=True)
    splits = nodes(out, "Split")
    assert len(splits) == 1, op_types(out)
    split = splits[0]
    assert split.input[0] == fused
    assert split_sizes(out, split) == [4, 1, 1]
    assert attr(split, "axis") == 2
    assert len(split.output) == 3
    readers = [n for n in out.graph.node if fused in n.input]
    assert [n.op_type for n in readers] == ["Split"]
    assert not {"GatherND"} & set(op_types(out))
    assert report.rules[RULE].rewrites == 1
    assert [o.name for o in out.graph.output] == [o.name for o in original.graph.output]
    feeds = fixture_feeds(name + ".onnx")
    reference = np.load(fixture_path(name + ".npz"))["output"]
    (actual,) = run_ort(out, feeds)
    (expected,) = run_ort(original, feeds)
    np.testing.assert_allclose(actual, expected, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(actual, reference, rtol=1e-4, atol=1e-5)
    assert_second_run_changes_nothing(out, list(report.rules), level=level)


def test_mqa_fixture_needs_the_canonicalizers_for_dynamo():
    """Without gathernd_to_gather and friends, the dynamo form is not a Split candidate."""
    out, report = run(fixture_path("mqa_dynamo.onnx"))
    assert "Split" not in op_types(out)
    assert report.rules[RULE].rewrites == 0


# ---- tiny graphs --------------------------------------------------------------------
TILED = """
    s0 = Constant <value = int64[1] {0}> ()
    e0 = Constant <value = int64[1] {4}> ()
    ax = Constant <value = int64[1] {1}> ()
    a = Slice(x, s0, e0, ax)
    i1 = Constant <value = int64[1] {4}> ()
    b = Gather <axis = 1> (x, i1)
    i2 = Constant <value = int64[1] {5}> ()
    c = Gather <axis = 1> (x, i2)
"""
TILED_OUT = "float[2,4,4] a, float[2,1,4] b, float[2,1,4] c"
TILED_Y = """
    t0 = Constant <value = int64[1] {0}> ()
    f0 = Constant <value = int64[1] {4}> ()
    bx = Constant <value = int64[1] {1}> ()
    d = Slice(y, t0, f0, bx)
    j1 = Constant <value = int64[1] {4}> ()
    e = Gather <axis = 1> (y, j1)
    j2 = Constant <value = int64[1] {5}> ()
    f = Gather <axis = 1> (y, j2)
"""
TILED_Y_OUT = "float[2,4,4] d, float[2,1,4] e, float[2,1,4] f"


def check_split(model, sizes, axis, *, source="x", squeezes=0):
    out, report = run(model)
    onnx.checker.check_model(out, full_check=True)
    assert report.rules[RULE].rewrites == 1, report.format_table()
    (split,) = nodes(out, "Split")
    assert split.input[0] == source
    assert split_sizes(out, split) == sizes
    assert attr(split, "axis") == axis
    assert len(nodes(out, "Squeeze")) == squeezes
    assert not nodes(out, "Gather") and not nodes(out, "Slice")
    assert [o.name for o in out.graph.output] == [o.name for o in model.graph.output]
    assert [o.type for o in out.graph.output] == [o.type for o in model.graph.output]
    assert_same_outputs(model, out, atol=0, rtol=0)
    assert_second_run_changes_nothing(out, [RULE])
    return out


def test_candidate_graph_input_and_outputs_keep_their_names():
    out = check_split(build(TILED, outputs=TILED_OUT), [4, 1, 1], 1)
    assert list(out.graph.node[0].output) == ["a", "b", "c"]
    assert [n.op_type for n in out.graph.node] == ["Split"]


def test_candidate_node_output():
    body = "x = Relu(inp)\n" + TILED
    model = build(body, inputs="float[2,6,4] inp", outputs=TILED_OUT)
    out = check_split(model, [4, 1, 1], 1)
    assert op_types(out) == ["Relu", "Split"]


def test_candidate_initializer():
    values = ", ".join(str(v) for v in range(48))
    body = TILED.replace("a = Slice", "a0 = Slice").replace("b = Gather", "b0 = Gather") \
        .replace("c = Gather", "c0 = Gather") + "a = Add(a0, y)\nb = Add(b0, y)\nc = Add(c0, y)\n"
    model = build(body, inputs="float[2,1,4] y", outputs=TILED_OUT,
                  inits=f"<float[2,6,4] x = {{{values}}}>")
    out = check_split(model, [4, 1, 1], 1)
    assert [t.name for t in out.graph.initializer if t.name == "x"] == ["x"]


def test_initializer_that_is_also_a_graph_input_is_still_a_candidate():
    """The tensor itself need not be constant: only its shape matters."""
    model = build(TILED, outputs=TILED_OUT)
    model.graph.initializer.append(numpy_helper.from_array(np.ones((2, 6, 4), np.float32), "x"))
    check_split(model, [4, 1, 1], 1)


def test_negative_axis_and_negative_indices_are_normalised():
    body = """
        s0 = Constant <value = int64[1] {-6}> ()
        e0 = Constant <value = int64[1] {-2}> ()
        ax = Constant <value = int64[1] {-2}> ()
        a = Slice(x, s0, e0, ax)
        i1 = Constant <value = int64[1] {-2}> ()
        b = Gather <axis = -2> (x, i1)
        i2 = Constant <value = int64[1] {-1}> ()
        c = Gather <axis = -2> (x, i2)
    """
    check_split(build(body, outputs=TILED_OUT), [4, 1, 1], 1)


def test_scalar_index_gather_gets_a_squeeze():
    body = """
        s0 = Constant <value = int64[1] {0}> ()
        e0 = Constant <value = int64[1] {4}> ()
        ax = Constant <value = int64[1] {1}> ()
        a = Slice(x, s0, e0, ax)
        i1 = Constant <value = int64 {4}> ()
        b = Gather <axis = 1> (x, i1)
        i2 = Constant <value = int64 {-1}> ()
        c = Gather <axis = 1> (x, i2)
    """
    out = check_split(build(body, outputs="float[2,4,4] a, float[2,4] b, float[2,4] c"),
                      [4, 1, 1], 1, squeezes=2)
    for squeeze in nodes(out, "Squeeze"):
        assert init_value(out, squeeze.input[1]).tolist() == [1]
    assert sorted(n.output[0] for n in nodes(out, "Squeeze")) == ["b", "c"]


def test_pieces_in_any_order_are_sorted_along_the_axis():
    body = """
        i0 = Constant <value = int64[1] {5}> ()
        c = Gather <axis = 1> (x, i0)
        s0 = Constant <value = int64[1] {1}> ()
        e0 = Constant <value = int64[1] {5}> ()
        ax = Constant <value = int64[1] {1}> ()
        b = Slice(x, s0, e0, ax)
        i1 = Constant <value = int64[1] {0}> ()
        a = Gather <axis = 1> (x, i1)
    """
    out = check_split(build(body, outputs="float[2,1,4] c, float[2,4,4] b, float[2,1,4] a"),
                      [1, 4, 1], 1)
    assert list(nodes(out, "Split")[0].output) == ["a", "b", "c"]


def test_slice_bounds_are_clamped():
    body = f"""
        s0 = Constant <value = int64[1] {{-100}}> ()
        e0 = Constant <value = int64[1] {{3}}> ()
        ax = Constant <value = int64[1] {{1}}> ()
        a = Slice(x, s0, e0, ax)
        s1 = Constant <value = int64[1] {{3}}> ()
        e1 = Constant <value = int64[1] {{{INT64_MAX}}}> ()
        b = Slice(x, s1, e1, ax)
    """
    check_split(build(body, outputs="float[2,3,4] a, float[2,3,4] b"), [3, 3], 1)


def test_slice_without_axes_uses_axis_0():
    body = """
        s0 = Constant <value = int64[1] {0}> ()
        e0 = Constant <value = int64[1] {1}> ()
        a = Slice(x, s0, e0)
        s1 = Constant <value = int64[1] {1}> ()
        e1 = Constant <value = int64[1] {2}> ()
        b = Slice(x, s1, e1)
    """
    check_split(build(body, outputs="float[1,6,4] a, float[1,6,4] b"), [1, 1], 0)


def test_int32_indices_are_accepted():
    body = """
        s0 = Constant <value = int32[1] {0}> ()
        e0 = Constant <value = int32[1] {4}> ()
        ax = Constant <value = int32[1] {1}> ()
        a = Slice(x, s0, e0, ax)
        i1 = Constant <value = int32[1] {4}> ()
        b = Gather <axis = 1> (x, i1)
        i2 = Constant <value = int32 {5}> ()
        c = Gather <axis = 1> (x, i2)
    """
    out = check_split(build(body, outputs="float[2,4,4] a, float[2,1,4] b, float[2,4] c"),
                      [4, 1, 1], 1, squeezes=1)
    (split,) = nodes(out, "Split")
    assert init_value(out, split.input[1]).dtype == np.int64


def _stepped(step: int) -> onnx.ModelProto:
    body = f"""
        s0 = Constant <value = int64[1] {{0}}> ()
        e0 = Constant <value = int64[1] {{4}}> ()
        ax = Constant <value = int64[1] {{1}}> ()
        st = Constant <value = int64[1] {{{step}}}> ()
        a = Slice(x, s0, e0, ax, st)
        s1 = Constant <value = int64[1] {{4}}> ()
        e1 = Constant <value = int64[1] {{6}}> ()
        b = Slice(x, s1, e1, ax, st)
    """
    shape = [4 // step, 2 // step]
    return build(body, outputs=f"float[2,{shape[0]},4] a, float[2,{shape[1]},4] b")


def test_explicit_step_1_is_accepted():
    check_split(_stepped(1), [4, 2], 1)


def test_step_2_is_rejected():
    assert_unchanged(_stepped(2), "step 2")


def test_overlap_changes_nothing_and_explain_says_overlap():
    report = assert_unchanged(overlapping_slices_model(), "overlap")
    assert "overlap at 3" in report.format_explain(RULE)


@pytest.mark.parametrize("index,reason", [
    pytest.param(5, "gap at 5", id="gap"),                          # [0, 3) and [5]: 3, 4 missing
    pytest.param(3, "stop at 4, size is 6", id="short_of_the_end"),  # [0, 3) and [3]: 4, 5 missing
])
def test_pieces_not_tiling_the_axis_change_nothing(index, reason):
    body = f"""
        s0 = Constant <value = int64[1] {{0}}> ()
        e0 = Constant <value = int64[1] {{3}}> ()
        ax = Constant <value = int64[1] {{1}}> ()
        a = Slice(x, s0, e0, ax)
        i1 = Constant <value = int64[1] {{{index}}}> ()
        b = Gather <axis = 1> (x, i1)
    """
    assert_unchanged(build(body, outputs="float[2,3,4] a, float[2,1,4] b"), reason)


def test_pieces_stopping_one_short_of_the_end_change_nothing():
    """[0, 3) and [3, 5) on an axis of size 6: element 5 is not covered, no Split."""
    body = """
        s0 = Constant <value = int64[1] {0}> ()
        e0 = Constant <value = int64[1] {3}> ()
        e1 = Constant <value = int64[1] {5}> ()
        ax = Constant <value = int64[1] {1}> ()
        a = Slice(x, s0, e0, ax)
        b = Slice(x, e0, e1, ax)
    """
    assert_unchanged(build(body, outputs="float[2,3,4] a, float[2,2,4] b"), "stop at 5, size is 6")


def test_consumers_on_different_axes():
    """Two pieces tile axis 1; the Gather on axis 2 is not part of it and stays."""
    body = """
        s0 = Constant <value = int64[1] {0}> ()
        e0 = Constant <value = int64[1] {2}> ()
        ax = Constant <value = int64[1] {1}> ()
        a = Slice(x, s0, e0, ax)
        s1 = Constant <value = int64[1] {2}> ()
        e1 = Constant <value = int64[1] {6}> ()
        b = Slice(x, s1, e1, ax)
        i2 = Constant <value = int64[1] {0}> ()
        c = Gather <axis = 2> (x, i2)
    """
    model = build(body, outputs="float[2,2,4] a, float[2,4,4] b, float[2,6,1] c")
    out, report = run(model)
    assert report.rules[RULE].rewrites == 1
    (split,) = nodes(out, "Split")
    assert split_sizes(out, split) == [2, 4] and attr(split, "axis") == 1
    (gather,) = nodes(out, "Gather")
    assert gather.input[0] == "x" and gather.output[0] == "c"
    assert_same_outputs(model, out, atol=0, rtol=0)
    assert_second_run_changes_nothing(out, [RULE])


def test_one_consumer_per_axis_changes_nothing():
    body = """
        i1 = Constant <value = int64[1] {0}> ()
        a = Gather <axis = 1> (x, i1)
        b = Gather <axis = 2> (x, i1)
    """
    assert_unchanged(build(body, outputs="float[2,1,4] a, float[2,6,1] b"),
                     "no two Gather/Slice consumers share an axis")


def test_other_consumers_keep_reading_the_original_tensor():
    body = TILED + "r = Relu(x)\n"
    model = build(body, outputs=TILED_OUT + ", float[2,6,4] r")
    out, report = run(model)
    assert report.rules[RULE].rewrites == 1
    (relu,) = nodes(out, "Relu")
    assert list(relu.input) == ["x"]
    (split,) = nodes(out, "Split")
    assert split.input[0] == "x" and split_sizes(out, split) == [4, 1, 1]
    assert_same_outputs(model, out, atol=0, rtol=0)
    assert_second_run_changes_nothing(out, [RULE])


def test_shape_output_is_not_a_candidate():
    body = """
        x = Shape(y)
        i0 = Constant <value = int64[1] {0}> ()
        a = Gather <axis = 0> (x, i0)
        s1 = Constant <value = int64[1] {1}> ()
        e1 = Constant <value = int64[1] {3}> ()
        ax = Constant <value = int64[1] {0}> ()
        b = Slice(x, s1, e1, ax)
    """
    model = build(body, inputs="float[2,6,4] y", outputs="int64[1] a, int64[2] b")
    assert_unchanged(model, "Shape")


@pytest.mark.parametrize("opset", [11, 12])
def test_opsets_11_and_12_get_their_own_split_and_squeeze_forms(opset):
    model = build(TILED.replace("(x, i2)", "(x, i2s)").replace(
        "i2 = Constant <value = int64[1] {5}>", "i2s = Constant <value = int64 {5}>"),
        outputs="float[2,4,4] a, float[2,1,4] b, float[2,4] c", opset=opset)
    out, report = run(model)
    onnx.checker.check_model(out, full_check=True)
    assert op_types(out) == ["Split", "Squeeze"]
    split, squeeze = out.graph.node
    assert list(split.input) == ["x"] and attr(split, "split") == [4, 1, 1]
    assert attr(split, "axis") == 1
    assert list(squeeze.input) == [split.output[2]] and attr(squeeze, "axes") == [1]
    assert_same_outputs(model, out, atol=0, rtol=0)
    assert_second_run_changes_nothing(out, [RULE])


def test_opset_10_is_gated_and_explain_says_by_what():
    report = assert_unchanged(build(TILED, outputs=TILED_OUT, opset=10), opset_gated=True)
    assert report.format_explain(RULE) == (
        f"{RULE}: did not run: gated by opset: needs opset 11 of 'ai.onnx' (the model has 10)")


def test_opset_13_takes_sizes_as_an_input():
    check_split(build(TILED, outputs=TILED_OUT, opset=13), [4, 1, 1], 1)


def test_explain_says_a_rule_is_gated_by_level_or_disabled():
    model = build(TILED, outputs=TILED_OUT)
    _, report = graphopt.optimize(model, level=1, explain=["matmul_scale_to_fused_matmul"])
    assert report.format_explain("matmul_scale_to_fused_matmul").endswith(
        "did not run: gated by level: a level-2 rule, the level is 1")
    _, report = graphopt.optimize(model, disable=[RULE], explain=[RULE])
    assert report.format_explain(RULE).endswith("did not run: disabled (--disable)")


def test_unknown_size_on_the_axis_changes_nothing_with_a_reason():
    model = build(TILED, inputs="float[2,N,4] x",
                  outputs="float[2,4,4] a, float[2,1,4] b, float[2,1,4] c")
    assert_unchanged(model, "size of axis 1 of 'x' is not static")


def test_unknown_size_on_another_axis_does_not_matter():
    model = build(TILED, inputs="float[B,6,T] x", outputs="float[B,4,T] a, float[B,1,T] b, "
                  "float[B,1,T] c")
    check_split(model, [4, 1, 1], 1)


def test_gather_index_out_of_range_changes_nothing():
    body = TILED.replace("int64[1] {5}", "int64[1] {6}")
    assert_unchanged(build(body, outputs=TILED_OUT), "index 6 is out of range for size 6")


def test_gather_with_two_indices_changes_nothing():
    body = TILED.replace("i1 = Constant <value = int64[1] {4}>",
                         "i1 = Constant <value = int64[2] {4, 5}>").replace(
        "i2 = Constant <value = int64[1] {5}> ()\n    c = Gather <axis = 1> (x, i2)\n", "")
    assert_unchanged(build(body, outputs="float[2,4,4] a, float[2,2,4] b"),
                     "not a constant one-element int tensor")


@pytest.mark.parametrize("read_inside", [False, True])
def test_gather_index_of_shape_1_1_changes_nothing(read_inside):
    """A Gather index fuses as a scalar or of shape [1] only; [1, 1] adds a dimension (it was fused
    and rolled back, or, read by another node, broke the whole-model check)."""
    body = TILED.replace("i1 = Constant <value = int64[1] {4}>",
                         "i1 = Constant <value = int64[1,1] {4}>")
    if read_inside:
        body = body.replace("b = Gather", "b0 = Gather") + "b = Relu(b0)\n"
    model = build(body, outputs="float[2,4,4] a, float[2,1,1,4] b, float[2,1,4] c")
    assert_unchanged(model, "index has shape [1, 1], not scalar or [1]")


def test_non_constant_index_changes_nothing():
    body = TILED.replace("i2 = Constant <value = int64[1] {5}> ()", "")
    model = build(body, inputs="float[2,6,4] x, int64[1] i2", outputs=TILED_OUT)
    assert_unchanged(model, "not a constant one-element int tensor")


def test_piece_output_that_is_graph_output_and_also_read_inside():
    body = TILED.replace("a = Slice", "q = Slice").replace("b = Gather", "k = Gather") + \
        "a = Relu(q)\nb = Neg(k)\n"
    model = build(body, outputs="float[2,4,4] a, float[2,1,4] b, float[2,1,4] c, float[2,4,4] q")
    out, report = run(model)
    assert report.rules[RULE].rewrites == 1
    assert list(nodes(out, "Split")[0].output) == ["q", "k", "c"]
    assert [o.name for o in out.graph.output] == ["a", "b", "c", "q"]
    assert_same_outputs(model, out, atol=0, rtol=0)


def test_new_names_are_unique_for_unnamed_nodes():
    """Two fusions in one graph of unnamed nodes: distinct Split names and initializers."""
    model = build(TILED + TILED_Y, inputs="float[2,6,4] x, float[2,6,4] y",
                  outputs=TILED_OUT + ", " + TILED_Y_OUT)
    out, report = run(model)
    assert report.rules[RULE].rewrites == 2
    splits = nodes(out, "Split")
    assert len(splits) == 2
    assert len({s.name for s in splits}) == 2 and all(s.name for s in splits)
    assert len({s.input[1] for s in splits}) == 2
    names = [t.name for t in out.graph.initializer]
    assert len(names) == len(set(names))
    onnx.checker.check_model(out, full_check=True)
    assert_same_outputs(model, out, atol=0, rtol=0)


def test_new_names_do_not_collide_with_existing_ones():
    """A model that already uses the names the rule would pick (e.g. after one run)."""
    body = """
        split_sizes = Constant <value = int64[1] {7}> ()
        squeeze_axes = Constant <value = int64[1] {8}> ()
        k = Add(split_sizes, squeeze_axes)
    """ + TILED.replace("int64[1] {5}", "int64 {5}")
    model = build(body, outputs=TILED_OUT.replace("float[2,1,4] c", "float[2,4] c")
                  + ", int64[1] k")
    gathers = [n for n in model.graph.node if n.op_type == "Gather"]
    gathers[0].name = "gather_slice_to_split/Split"  # the names the rule's nodes would take
    gathers[1].name = "gather_slice_to_split/Squeeze"
    first, report = run(model)
    assert report.rules[RULE].rewrites == 1
    all_node_names = [n.name for n in first.graph.node if n.name]
    assert len(all_node_names) == len(set(all_node_names))
    tensors = [o for n in first.graph.node for o in n.output] + \
        [t.name for t in first.graph.initializer]
    assert len(tensors) == len(set(tensors))
    onnx.checker.check_model(first, full_check=True)
    assert_same_outputs(model, first, atol=0, rtol=0)
    # Second optimizer run on a model that now holds "split_sizes" & co., with a new fan-out.
    second_model = onnx.ModelProto()
    second_model.CopyFrom(first)
    extra = build(TILED_Y, inputs="float[2,6,4] y", outputs=TILED_Y_OUT)
    second_model.graph.input.extend(extra.graph.input)
    second_model.graph.output.extend(extra.graph.output)
    second_model.graph.node.extend(extra.graph.node)
    onnx.checker.check_model(second_model)
    second, report = run(second_model)
    assert report.rules[RULE].rewrites == 1
    splits = nodes(second, "Split")
    assert len(splits) == 2 and len({s.name for s in splits}) == 2
    assert len({s.input[1] for s in splits}) == 2
    tensors = [o for n in second.graph.node for o in n.output] + \
        [t.name for t in second.graph.initializer]
    assert len(tensors) == len(set(tensors))
    onnx.checker.check_model(second, full_check=True)
    assert_same_outputs(second_model, second, atol=0, rtol=0)


def test_second_run_on_the_original_model_is_byte_identical_too():
    model = build(TILED, outputs=TILED_OUT)
    first, _ = run(model)
    second, _ = run(model)
    assert first.SerializeToString() == second.SerializeToString()  # deterministic
    assert_second_run_changes_nothing(first, [RULE])

"""fold_constants: nodes computing small constants from constants -> initializers."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper
from support.models import (
    assert_no_change,
    assert_same_outputs,
    assert_second_run_changes_nothing,
    model_from_text,
    op_types,
)

import graphopt

PASS = "fold_constants"


def run(model):
    return graphopt.optimize(model, [PASS])


def initializer(model, name):
    (t,) = [t for t in model.graph.initializer if t.name == name]
    return numpy_helper.to_array(t)


def test_unsqueeze_of_constants_becomes_an_initializer():
    model = model_from_text("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2,6,4] x) => (float[2,4,4] y) {
          c0 = Constant <value = int64 {0}> ()
          c4 = Constant <value = int64 {4}> ()
          ax = Constant <value = int64[1] {0}> ()
          s = Unsqueeze(c0, ax)
          e = Unsqueeze(c4, ax)
          one = Constant <value = int64[1] {1}> ()
          y = Slice(x, s, e, one)
        }""")
    out, report = run(model)
    assert op_types(out) == ["Constant", "Slice"]  # 'one' is a Constant node already
    assert initializer(out, "s").tolist() == [0] and initializer(out, "e").tolist() == [4]
    assert initializer(out, "s").dtype == np.int64
    assert {t.name for t in out.graph.initializer} == {"s", "e"}  # c0, c4, ax are gone
    assert report.rules[PASS].rewrites == 2
    onnx.checker.check_model(out, full_check=True)
    assert_same_outputs(model, out, atol=0, rtol=0)
    assert_second_run_changes_nothing(out, [PASS])


def test_chain_of_constant_arithmetic_folds_to_one_value():
    model = model_from_text("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[3] x) => (float[3] y) <float[3] a = {1.0, 2.0, 3.0}, float[3] b = {0.5, 0.5, 2.0}>
        {
          p = Mul(a, b)
          q = Add(p, a)
          y = Add(x, q)
        }""")
    out, _ = run(model)
    assert op_types(out) == ["Add"]
    np.testing.assert_array_equal(initializer(out, "q"), np.array([1.5, 3.0, 9.0], np.float32))
    assert [t.name for t in out.graph.initializer] == ["q"]
    assert_same_outputs(model, out, atol=0, rtol=0)
    assert_second_run_changes_nothing(out, [PASS])


def test_node_reading_a_runtime_input_stays():
    model = model_from_text("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[3] x) => (float[3] y) <float[3] a = {1.0, 2.0, 3.0}> {
          y = Mul(x, a)
        }""")
    report = assert_no_change(model, [PASS])
    assert report.rules[PASS].rewrites == 0


def test_initializer_that_is_also_a_graph_input_is_not_a_constant():
    model = model_from_text("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[3] x, float[3] a) => (float[3] y) <float[3] a = {1.0, 2.0, 3.0}> {
          b = Neg(a)
          y = Add(x, b)
        }""")
    assert_no_change(model, [PASS])


def test_node_producing_a_graph_output_stays():
    model = model_from_text("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[3] x) => (float[3] y, float[3] k) <float[3] a = {1.0, 2.0, 3.0}> {
          k = Neg(a)
          y = Add(x, k)
        }""")
    assert_no_change(model, [PASS])


def test_large_results_are_not_folded():
    """Folding Transpose(W) of a real weight would duplicate it: 4096 elements at most."""
    w = numpy_helper.from_array(np.ones((64, 65), np.float32), "W")
    small = numpy_helper.from_array(np.ones((64, 64), np.float32), "S")
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("Transpose", ["W"], ["wt"], perm=[1, 0]),
         onnx.helper.make_node("Add", ["x", "wt"], ["y"]),
         onnx.helper.make_node("Transpose", ["S"], ["st"], perm=[1, 0]),
         onnx.helper.make_node("Add", ["z", "st"], ["v"])], "g",
        [onnx.helper.make_tensor_value_info("x", 1, [65, 64]),
         onnx.helper.make_tensor_value_info("z", 1, [64, 64])],
        [onnx.helper.make_tensor_value_info("y", 1, [65, 64]),
         onnx.helper.make_tensor_value_info("v", 1, [64, 64])], initializer=[w, small])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    out, report = run(model)
    assert op_types(out) == ["Transpose", "Add", "Add"]  # 4160 elements: kept; 4096: folded
    assert {t.name for t in out.graph.initializer} == {"W", "st"}
    assert report.rules[PASS].rewrites == 1
    assert_same_outputs(model, out, atol=0, rtol=0)
    assert_second_run_changes_nothing(out, [PASS])


@pytest.mark.parametrize("node", [
    "y = Bernoulli(p)",
    "y = Multinomial <sample_size = 2> (logits)",
    "y, mask = Dropout(v, ratio, train)",
])
def test_random_results_of_constant_inputs_are_not_folded(node):
    """Folding would freeze one draw into the model: every run must draw anew."""
    model = model_from_text(f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g () => (float[2, 2] out) {{
          p = Constant <value = float[2, 2] {{0.5, 0.5, 0.5, 0.5}}> ()
          logits = Constant <value = float[2, 2] {{0.0, 0.0, 0.0, 0.0}}> ()
          v = Constant <value = float[2, 2] {{1.0, 2.0, 3.0, 4.0}}> ()
          ratio = Constant <value = float {{0.5}}> ()
          train = Constant <value = bool {{1}}> ()
          {node}
          yf = Cast <to = 1> (y)
          out = Identity(yf)
        }}""")
    out, _ = run(model)
    assert node.split("= ")[1].split(" ")[0].split("(")[0] in op_types(out)


def test_small_inputs_with_a_large_result_are_not_folded():
    """The limit is on the result too: Expand of a 1-element constant to 64 x 65 (4160
    elements) stays a node; to 64 x 64 (4096) it is folded."""
    def expand_to(rows: int, cols: int) -> onnx.ModelProto:
        return model_from_text(f"""
            <ir_version: 8, opset_import: ["" : 17]>
            g (float[{rows},{cols}] x) => (float[{rows},{cols}] y) {{
              one = Constant <value = float[1] {{1.0}}> ()
              shape = Constant <value = int64[2] {{{rows}, {cols}}}> ()
              big = Expand(one, shape)
              y = Add(x, big)
            }}""")
    kept, report = run(expand_to(64, 65))
    assert "Expand" in op_types(kept)
    assert not any(t.name == "big" for t in kept.graph.initializer)
    folded, _ = run(expand_to(64, 64))
    assert "Expand" not in op_types(folded)
    assert initializer(folded, "big").shape == (64, 64)


def test_random_and_contrib_ops_are_not_folded():
    model = model_from_text("""
        <ir_version: 8, opset_import: ["" : 17, "com.microsoft" : 1]>
        g (float[2,3] x) => (float[2,3] y, float[2,3] r)
          <float[2,3] a = {1.0, 2.0, 3.0, 4.0, 5.0, 6.0}> {
          r = RandomNormalLike(a)
          g = com.microsoft.Gelu(a)
          y = Add(x, g)
        }""")
    report = assert_no_change(model, [PASS])
    assert report.rules[PASS].rewrites == 0


def test_node_with_a_subgraph_is_not_folded():
    model = model_from_text("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[1] x) => (float[1] y) <bool c = {1}, float[1] a = {1.0}> {
          k = If (c) <then_branch = t () => (float[1] o) { o = Neg(a) },
                      else_branch = e () => (float[1] o2) { o2 = Identity(a) }>
          y = Add(x, k)
        }""")
    report = assert_no_change(model, [PASS])
    assert report.rules[PASS].rewrites == 0


SHAPE_ARITHMETIC = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[{batch}, 4, 6] x) => (float[{batch}, 24] y) {{
  s = Shape <start = 0, end = 1> (x)
  n = Size(x)
  per_row = Div(n, s)
  target = Concat <axis = 0> (s, per_row)
  y = Reshape(x, target)
}}
"""


def test_shape_and_size_of_a_fully_known_shape_fold():
    model = model_from_text(SHAPE_ARITHMETIC.format(batch=2))
    out, report = run(model)
    assert op_types(out) == ["Reshape"]
    np.testing.assert_array_equal(initializer(out, "target"), [2, 24])
    assert_same_outputs(model, out)
    assert_second_run_changes_nothing(out, [PASS])


def test_shape_of_a_symbolic_dimension_stays():
    model = model_from_text(SHAPE_ARITHMETIC.format(batch='"N"'))
    assert_no_change(model, [PASS])

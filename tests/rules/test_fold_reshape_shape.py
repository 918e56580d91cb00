"""fold_reshape_shape: Reshape(x, computed shape) -> Reshape(x, constant) when each entry is a
constant or x's own dimension at that position (written as 0)."""
from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper
from support.models import (
    assert_no_change,
    assert_same_outputs,
    assert_second_run_changes_nothing,
    model_from_text,
    op_types,
)

import graphopt

PASS = "fold_reshape_shape"


def target(model, index=0):
    values = {t.name: numpy_helper.to_array(t).tolist() for t in model.graph.initializer}
    reshapes = [n for n in model.graph.node if n.op_type == "Reshape"]
    return values.get(reshapes[index].input[1])


def feeds_of(*shapes):
    rng = np.random.default_rng(0)
    return [{"qkv": rng.standard_normal(s).astype(np.float32)} for s in shapes]


# Falcon's fused_qkv.view(batch, seq, heads + 2, head_dim), as TorchScript writes it
FALCON_VIEW = """
    <ir_version: 8, opset_import: ["" : 17]>
    g (float[B,S,96] qkv) => (float[B,S,6,16] y)
      <int64 i0 = {0}, int64 i1 = {1}, int64[1] ax = {0}, int64[1] heads = {6},
       int64[1] d = {16}> {
      s = Shape(qkv)
      b = Gather(s, i0)
      n = Gather(s, i1)
      ub = Unsqueeze(b, ax)
      un = Unsqueeze(n, ax)
      c = Concat <axis = 0> (ub, un, heads, d)
      y = Reshape(qkv, c)
    }"""


def test_falcon_qkv_view_gets_a_constant_target_and_its_shape_nodes_go():
    model = model_from_text(FALCON_VIEW)
    out, report = graphopt.optimize(model, [PASS])
    assert op_types(out) == ["Reshape"] and target(out) == [0, 0, 6, 16]
    assert report.rules[PASS].rewrites == 1
    onnx.checker.check_model(out, full_check=True)
    for feeds in feeds_of((1, 1, 96), (2, 5, 96), (3, 1, 96)):
        assert_same_outputs(model, out, feeds, atol=0, rtol=0)
    assert_second_run_changes_nothing(out, [PASS])


def test_with_allowzero_a_zero_is_a_size_so_the_copied_dims_stay_computed():
    model = model_from_text(FALCON_VIEW.replace("Reshape(qkv, c)",
                                                "Reshape <allowzero = 1> (qkv, c)"))
    assert_no_change(model, [PASS])


def test_an_entry_naming_another_position_stays():
    # (seq, batch, ...) is not a copy of qkv's own (batch, seq) at those positions
    model = model_from_text(FALCON_VIEW.replace("Concat <axis = 0> (ub, un, heads, d)",
                                                "Concat <axis = 0> (un, ub, heads, d)"))
    assert_no_change(model, [PASS])


def test_an_entry_with_the_same_origin_counts_and_a_known_size_is_written():
    # the batch size is read off the model input, the sequence off the projection: both are
    # the activation's own dims there; the last entry's size (96) is known
    model = model_from_text("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[B,S,96] x) => (float[B,S,96] y)
          <float[96,96] w = {WEIGHTS}, int64 i0 = {0}, int64 i1 = {1}, int64 i2 = {2},
           int64[1] ax = {0}> {
          h = MatMul(x, w)
          a = Relu(h)
          s = Shape(x)
          b = Gather(s, i0)
          ub = Unsqueeze(b, ax)
          sh = Shape(h)
          n = Gather(sh, i1)
          un = Unsqueeze(n, ax)
          f = Gather(sh, i2)
          uf = Unsqueeze(f, ax)
          t = Concat <axis = 0> (ub, un, uf)
          y = Reshape(a, t)
        }""".replace("WEIGHTS", ", ".join(["0.01"] * 96 * 96)))
    out, _ = graphopt.optimize(model, [PASS])
    assert op_types(out) == ["MatMul", "Relu", "Reshape"] and target(out) == [0, 0, 96]
    rng = np.random.default_rng(0)
    for b, s in ((1, 1), (2, 3)):
        feeds = {"x": rng.standard_normal((b, s, 96)).astype(np.float32)}
        assert_same_outputs(model, out, feeds, atol=0, rtol=0)


def test_an_entry_read_off_a_model_input_stays():
    # k's value is the caller's: nothing says it is x's dim
    model = model_from_text("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[B,S,8] x, int64[1] k) => (float[B,S,8] y) <int64[1] last = {8}> {
          t = Concat <axis = 0> (k, k, last)
          y = Reshape(x, t)
        }""")
    assert_no_change(model, [PASS])


def test_level_1_includes_it():
    assert PASS in {r.name for r in graphopt.select_rules(level=1)}

"""Shared test helpers: tiny models from ONNX text, the committed fixtures, and onnxruntime as an
oracle."""
from __future__ import annotations

import json
import os

import numpy as np
import onnx
import onnx.parser
import pytest

import graphopt

FIXTURES = os.path.join(os.path.dirname(os.path.dirname(__file__)), "fixtures")
# the Falcon MQA exports in fixtures/ (make_fixtures.py)
MQA_FIXTURES = ["mqa_opset14", "mqa_opset14_dynamic", "mqa_opset17", "mqa_opset17_dynamic",
                "mqa_dynamo", "mqa_dynamo_dynamic", "mqa_block"]


def model_from_text(text: str) -> onnx.ModelProto:
    model = onnx.parser.parse_model(text)
    onnx.checker.check_model(model)
    return model


def fixture_path(name: str) -> str:
    return os.path.join(FIXTURES, name)


def fixture_feeds(name: str) -> dict[str, np.ndarray]:
    data = np.load(fixture_path(name.replace(".onnx", ".npz")))
    meta = json.loads(str(data["__meta__"]))
    return {k: data[k] for k in meta["inputs"]}


def run_ort(model: onnx.ModelProto | str, feeds: dict) -> list[np.ndarray]:
    ort = pytest.importorskip("onnxruntime")
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    source = model if isinstance(model, str) else model.SerializeToString()
    return ort.InferenceSession(source, options, providers=["CPUExecutionProvider"]).run(None,
                                                                                          feeds)


def ort_optimized(model: onnx.ModelProto | str, tmp_path) -> onnx.ModelProto:
    """The model as onnxruntime's own ORT_ENABLE_EXTENDED optimizers leave it."""
    ort = pytest.importorskip("onnxruntime")
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    target = os.path.join(tmp_path, "ort_optimized.onnx")
    options.optimized_model_filepath = target
    source = model if isinstance(model, str) else model.SerializeToString()
    ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])
    return onnx.load(target)


def random_feeds(model: onnx.ModelProto, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    initializers = {t.name for t in model.graph.initializer}
    feeds = {}
    for vi in model.graph.input:
        if vi.name in initializers:
            continue
        t = vi.type.tensor_type
        shape = [d.dim_value if d.HasField("dim_value") else 2 for d in t.shape.dim]
        dtype = onnx.helper.tensor_dtype_to_np_dtype(t.elem_type)
        if np.issubdtype(dtype, np.integer):
            feeds[vi.name] = rng.integers(0, 3, shape).astype(dtype)
        else:
            feeds[vi.name] = rng.standard_normal(shape).astype(dtype)
    return feeds


def assert_same_outputs(before: onnx.ModelProto, after: onnx.ModelProto, feeds=None,
                        rtol=1e-5, atol=1e-6) -> None:
    feeds = feeds if feeds is not None else random_feeds(before)
    for expected, actual in zip(run_ort(before, feeds), run_ort(after, feeds), strict=True):
        np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol)


def op_types(model: onnx.ModelProto) -> list[str]:
    return [n.op_type for n in model.graph.node]


FUSED_MATMUL_DEFAULTS = {"alpha": 1.0, "transA": 0, "transB": 0, "transBatchA": 0,
                         "transBatchB": 0}


def fused(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.op_type == "FusedMatMul"]


def fused_attrs(node: onnx.NodeProto) -> dict:
    """A FusedMatMul's attributes with the schema defaults filled in."""
    attrs = dict(FUSED_MATMUL_DEFAULTS)
    attrs.update({a.name: onnx.helper.get_attribute_value(a) for a in node.attribute})
    return attrs


def overlapping_slices_model() -> onnx.ModelProto:
    """Two Slices of x on axis 1, [0, 4) and [3, 6): gather_slice_to_split declines (overlap)."""
    return model_from_text("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2,6,4] x) => (float[2,4,4] a, float[2,3,4] b) {
          s0 = Constant <value = int64[1] {0}> ()
          e0 = Constant <value = int64[1] {4}> ()
          ax = Constant <value = int64[1] {1}> ()
          a = Slice(x, s0, e0, ax)
          s1 = Constant <value = int64[1] {3}> ()
          e1 = Constant <value = int64[1] {6}> ()
          b = Slice(x, s1, e1, ax)
        }""")


# ---- optimizer checks shared by the rule tests ---------------------------------------------
def assert_no_change(model: onnx.ModelProto, rules, *, rollbacks: int = 0, **kw):
    """Optimizing `model` with `rules` (and `kw`) gives it back byte for byte, each rule
    declining rather than failing: a rule that raised or broke the model is rolled back
    whole, which would hide a wrong guard (``rollbacks``: how many the test expects); the
    report."""
    out, report = graphopt.optimize(model, list(rules), **kw)
    assert out.SerializeToString() == model.SerializeToString()
    rolled = {name: s.rollback_reasons for name, s in report.rules.items() if s.rollbacks}
    assert sum(s.rollbacks for s in report.rules.values()) == rollbacks, rolled
    claimed = {name: s.rewrites for name, s in report.rules.items() if s.rewrites}
    assert not claimed or rollbacks, f"rewrites reported for an unchanged model: {claimed}"
    return report


def assert_declined(model: onnx.ModelProto, rule: str, reason: str):
    """`rule` leaves `model` as it is, and its explain text says `reason`; the report."""
    report = assert_no_change(model, [rule], explain=[rule])
    text = report.format_explain(rule)
    assert reason in text, text
    return report


def assert_level_2_only(model: onnx.ModelProto, rule: str) -> None:
    """Level 1 leaves ``model`` byte for byte as it is and never runs ``rule``."""
    out, report = graphopt.optimize(model, level=1)
    assert out.SerializeToString() == model.SerializeToString()
    assert rule not in report.rules


def assert_second_run_changes_nothing(out: onnx.ModelProto, rules, **kw):
    """A rewritten model is a fixpoint: optimizing it again with `rules` runs each of them,
    rewrites nothing and gives it back byte for byte; the report."""
    report = assert_no_change(out, rules, **kw)
    assert set(rules) <= set(report.rules), report.format_table()
    assert all(s.rewrites == 0 for s in report.rules.values()), report.format_table()
    return report

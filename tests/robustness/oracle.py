"""The properties every optimized graph must have, checked against two oracles.

``check_optimize(model)``: graphopt.optimize (level 2) gives a model that
- passes onnx.checker.check_model(full_check=True) and strict shape inference,
- keeps the graph inputs and outputs (names, order, types),
- computes the same values: onnxruntime (original vs optimized; graphs without YieldOp) and
  the executor (original vs optimized; all graphs, YieldOp ones included),
- is a fixpoint: optimizing it again gives identical bytes,
and the model passed in is left untouched.
"""
from __future__ import annotations

import numpy as np
import onnx
from support.models import random_feeds

import graphopt

MS = "com.microsoft"


class KnownBugHit(AssertionError):
    """The example hit an open bug that has its own strict xfail regression test."""


def strict_check(model: onnx.ModelProto) -> None:
    onnx.checker.check_model(model, full_check=True)
    onnx.shape_inference.infer_shapes(model, check_type=True, strict_mode=True, data_prop=True)


def has_yield(model: onnx.ModelProto) -> bool:
    return any(n.op_type == "YieldOp" and n.domain == MS for n in model.graph.node)


def run_ort(model: onnx.ModelProto, feeds) -> dict[str, np.ndarray]:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.log_severity_level = 3
    session = ort.InferenceSession(model.SerializeToString(), options,
                                   providers=["CPUExecutionProvider"])
    names = [o.name for o in model.graph.output]
    return dict(zip(names, session.run(names, feeds), strict=True))


def run_executor(model: onnx.ModelProto, feeds) -> dict[str, np.ndarray]:
    from graphopt.executor import Session

    return Session(model, device="cpu", numerics=None).run(feeds)


def assert_close(expected: dict, actual: dict, what: str) -> None:
    assert list(expected) == list(actual), f"{what}: outputs differ {list(expected)} {list(actual)}"
    for name in expected:
        e, a = np.asarray(expected[name]), np.asarray(actual[name])
        assert e.shape == a.shape, f"{what}: output {name!r} shape {a.shape} != {e.shape}"
        assert e.dtype == a.dtype, f"{what}: output {name!r} dtype {a.dtype} != {e.dtype}"
        finite = np.abs(e[np.isfinite(e)]).astype(np.float64)
        scale = max(1.0, float(finite.max()) if finite.size else 1.0)
        rtol, atol = (2e-2, 2e-2) if e.dtype == np.float16 else (2e-4, 2e-5)
        np.testing.assert_allclose(a, e, rtol=rtol, atol=atol * scale, equal_nan=True,
                                   err_msg=f"{what}: output {name!r}")


def io_signature(model: onnx.ModelProto):
    return ([(vi.name, vi.type.SerializeToString()) for vi in model.graph.input],
            [(vi.name, vi.type.SerializeToString()) for vi in model.graph.output])


def check_optimize(model: onnx.ModelProto, *, level: int = 2, seed: int = 0,
                   use_ort: bool | None = None) -> tuple[onnx.ModelProto, object]:
    """All the properties above; returns (optimized model, report)."""
    strict_check(model)  # the generator only makes valid graphs
    before = model.SerializeToString()
    optimized, report = graphopt.optimize(model, level=level)
    assert model.SerializeToString() == before, "optimize() modified the model passed in"
    strict_check(optimized)
    assert io_signature(optimized) == io_signature(model), "graph inputs/outputs changed"

    feeds = random_feeds(model, seed)
    yields = has_yield(model)
    if use_ort is None:
        use_ort = not yields
    if use_ort:
        expected = run_ort(model, feeds)
        assert_close(expected, run_ort(optimized, feeds), "onnxruntime original vs optimized")
    reference = run_executor(model, feeds)
    assert_close(reference, run_executor(optimized, feeds), "executor original vs optimized")
    if use_ort:
        assert_close(expected, reference, "onnxruntime vs executor (original)")

    again, again_report = graphopt.optimize(optimized, level=level)
    if again.SerializeToString() != optimized.SerializeToString():
        from .known_bugs import fan_out_not_retried, stale_marks_after_level2, without_marks

        # Open bugs with their own strict xfail tests in test_regressions.py; recognised
        # here only while the bug is open (each is re-detected on its small graph), so the
        # property becomes strict again by itself once the bug is fixed.
        if yields and stale_marks_after_level2() and \
                without_marks(again) == without_marks(optimized):
            raise KnownBugHit("stale __backwardpass marks after a level-2 fusion "
                              "(test_fixpoint_when_a_level2_fusion_changes_what_feeds_yieldop)")
        if fan_out_not_retried() and set(again_report.fired) <= {
                "gather_slice_to_split", "mark_backward_pass", "fold_constants"}:
            raise KnownBugHit("fan-out Split fusion not retried after a rewrite freed it "
                              "(test_fixpoint_when_a_rewrite_frees_a_fan_out_tensor)")
        raise AssertionError("optimizing the optimized model changed it again (not a "
                             f"fixpoint; the second run fired {again_report.fired})")
    return optimized, report

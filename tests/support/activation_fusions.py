"""What the GELU fusion tests (tests/rules/test_gelu_fusion.py, test_fast_gelu_fusion.py)
share: retyping a float model, the Hugging Face exports' activation counts against
onnxruntime's, and the training check (fused before differentiation, same gradients)."""
from __future__ import annotations

import collections
import functools
import glob
import os
import tempfile

import numpy as np
import onnx

import graphopt
from graphopt.executor import Session
from graphopt.training.prepare import prepare_training
from support.models import (
    FIXTURES,
    assert_same_outputs,
    assert_second_run_changes_nothing,
    op_types,
    ort_optimized,
    random_feeds,
)


def retyped(model: onnx.ModelProto, dtype, exact: dict[str, float]) -> onnx.ModelProto:
    """``model`` with its inputs, outputs and constants of ``dtype``; a constant named in
    ``exact`` gets that float64 value rounded to ``dtype``, the others their own value."""
    elem = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    for value in [*model.graph.input, *model.graph.output]:
        value.type.tensor_type.elem_type = elem
    for tensor in model.graph.initializer:
        array = onnx.numpy_helper.to_array(tensor).astype(np.float64)
        array = np.full_like(array, exact.get(tensor.name, array.reshape(-1)[0]))
        tensor.CopyFrom(onnx.numpy_helper.from_array(array.astype(dtype), tensor.name))
    onnx.checker.check_model(model)
    return model


def hf_exports() -> list[str]:
    return sorted(os.path.basename(p)[:-5] for p in glob.glob(os.path.join(FIXTURES, "hf_*.onnx")))


@functools.cache
def fused_counts(name: str) -> tuple[collections.Counter, collections.Counter,
                                     collections.Counter]:
    """Op counts of the export ``name``: as exported, after graphopt's level 2, after
    onnxruntime's level 2 (computed once per test session: both fusion tests ask)."""
    model = onnx.load(os.path.join(FIXTURES, f"{name}.onnx"))
    ours = collections.Counter(op_types(graphopt.optimize(model, level=2)[0]))
    with tempfile.TemporaryDirectory() as scratch:
        theirs = collections.Counter(op_types(ort_optimized(model, scratch)))
    return collections.Counter(op_types(model)), ours, theirs


def mlp_model(activation: str, constants: str) -> onnx.ModelProto:
    """x @ w1 -> ``activation`` (ONNX text reading ``h``, writing ``y``) -> @ w2, weights as
    initializers."""
    rng = np.random.default_rng(0)
    model = onnx.parser.parse_model(f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[5,8] x, float[8,16] w1, float[16,4] w2) => (float[5,4] out) <{constants}>
        {{
        h = MatMul(x, w1)
        {activation}
        out = MatMul(y, w2)
        }}""")
    for name, shape in (("w1", (8, 16)), ("w2", (16, 4))):  # weights, not inputs
        model.graph.input.remove(next(i for i in model.graph.input if i.name == name))
        model.graph.initializer.append(onnx.numpy_helper.from_array(
            rng.standard_normal(shape).astype(np.float32), name))
    onnx.checker.check_model(model)
    return model


def assert_fused_before_differentiation(model, rule: str, fused_op: str, grad_op: str,
                                        unfused_op: str) -> None:
    """Training fuses the forward graph before differentiating it (one ``fused_op``, one
    ``grad_op``) and computes the loss and gradients of the graph differentiated through
    ``unfused_op``."""
    fused, reports = prepare_training(model, loss="mse")
    plain, _ = prepare_training(model, loss="mse", disable=(rule,))
    kinds = collections.Counter(op_types(fused.proto))
    assert kinds[fused_op] == 1 and kinds[grad_op] == 1 and kinds[unfused_op] == 0, kinds
    assert unfused_op in op_types(plain.proto)
    assert rule in reports[0][0] and reports[0][1].rules[rule].rewrites == 1
    feeds = random_feeds(fused.proto)
    wanted = fused.losses + [fused.grads[p] for p in fused.params]
    got = Session(fused.proto, device="cpu").run(feeds, wanted)
    expected = Session(plain.proto, device="cpu").run(feeds, wanted)
    for name in wanted:
        np.testing.assert_allclose(got[name], expected[name], rtol=1e-5, atol=1e-6)


def assert_same_in_the_executor(model: onnx.ModelProto, rule: str, fused_op: str) -> None:
    """``rule`` makes one ``fused_op`` of ``model`` (float16 or float64, which onnxruntime's
    CPU kernels do not all take), and the executor computes the same either way."""
    out, _ = graphopt.optimize(model, [rule])
    assert op_types(out) == [fused_op]
    feeds = random_feeds(model)
    (expected,) = Session(model, device="cpu").run(feeds).values()
    (actual,) = Session(out, device="cpu").run(feeds).values()
    tolerance = 2e-3 if expected.dtype == np.float16 else 1e-12
    np.testing.assert_allclose(actual, expected, rtol=tolerance, atol=tolerance)


def assert_fused_into_one_node(model: onnx.ModelProto, rule: str, fused_op: str,
                               tolerance: float) -> None:
    """``rule`` turns ``model`` (x -> y) into one com.microsoft ``fused_op``(x) -> y, its
    constants gone with the nodes, computing what it did in onnxruntime within
    ``tolerance``; optimizing again changes nothing."""
    out, report = graphopt.optimize(model, [rule])
    assert op_types(out) == [fused_op]
    (node,) = out.graph.node
    assert node.domain == "com.microsoft"
    assert list(node.input) == ["x"] and list(node.output) == ["y"]
    assert [t.name for t in out.graph.initializer] == []  # the constants died with the nodes
    assert report.rules[rule].rewrites == 1
    assert_same_outputs(model, out, rtol=tolerance, atol=1e-6)  # onnxruntime runs both
    assert_second_run_changes_nothing(out, [rule])

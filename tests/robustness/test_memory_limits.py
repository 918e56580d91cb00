"""executor/memory.py: a plan whose peak memory cannot fit is refused before anything runs,
with the estimate in the message (not killed half-way by the OS)."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from graphopt.executor import ExecutorError, Session, memory
from graphopt.executor.memory import MemoryLimitError, planned_peak

F = TensorProto.FLOAT


def _model(nodes, inputs, outputs, inits=()):
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


def huge_declared_model() -> onnx.ModelProto:
    """x[2**20, 2**20] float (4 TiB) -> Relu -> y."""
    return _model([helper.make_node("Relu", ["x"], ["y"])],
                  [helper.make_tensor_value_info("x", F, [2**20, 2**20])],
                  [helper.make_tensor_value_info("y", F, [2**20, 2**20])])


def outer_product_model() -> onnx.ModelProto:
    """a[N, 1] @ b[1, N] -> [N, N]: tiny feeds, a huge intermediate for a big N."""
    return _model([helper.make_node("MatMul", ["a", "b"], ["p"]),
                   helper.make_node("ReduceSum", ["p"], ["s"], keepdims=0)],
                  [helper.make_tensor_value_info("a", F, ["N", 1]),
                   helper.make_tensor_value_info("b", F, [1, "N"])],
                  [helper.make_tensor_value_info("s", F, [])])


def test_huge_declared_dims_are_refused_at_plan_time_with_the_estimate(monkeypatch):
    monkeypatch.delenv(memory.ENV, raising=False)
    with pytest.raises(MemoryLimitError) as info:
        Session(huge_declared_model(), device="cpu", numerics=None)
    message = str(info.value)
    assert message.startswith("planned peak memory 8.0 TiB exceeds the ")
    assert "GiB available on cpu" in message and "nothing was run" in message
    assert isinstance(info.value, ExecutorError)
    assert info.value.peak == 2 * 4 * 2**40


def test_dynamic_dims_are_checked_at_run_start_before_any_node(monkeypatch):
    monkeypatch.setenv(memory.ENV, "1G")
    session = Session(outer_product_model(), device="cpu", numerics=None)
    small = np.ones((64, 1), np.float32)
    assert session.run({"a": small, "b": small.T})["s"] == 64 * 64
    ran = []
    n = 1 << 15  # [N, N] float32 = 4 GiB > 1 GiB; the feeds are 128 KiB each
    with pytest.raises(MemoryLimitError, match=r"planned peak memory 4\.0 GiB exceeds the "
                                               r"1\.0 GiB available on cpu"):
        session.run({"a": np.ones((n, 1), np.float32), "b": np.ones((1, n), np.float32)},
                    observer=lambda *args: ran.append(args))
    assert ran == []  # refused before the first node


def test_the_limit_can_be_turned_off(monkeypatch):
    monkeypatch.setenv(memory.ENV, "off")
    Session(huge_declared_model(), device="cpu", numerics=None)  # planned, never run


def test_peak_follows_the_last_use_table(monkeypatch):
    """x -> a -> b -> c, each 1 MiB: a dies once b is made, so at most 2 live at a step
    (plus x until its last use, plus the 1 MiB weight)."""
    monkeypatch.setenv(memory.ENV, "off")
    mib = 1 << 18  # float32 elements in 1 MiB
    w = numpy_helper.from_array(np.ones(mib, np.float32), "w")
    model = _model([helper.make_node("Add", ["x", "w"], ["a"]),
                    helper.make_node("Relu", ["a"], ["b"]),
                    helper.make_node("Neg", ["b"], ["c"])],
                   [helper.make_tensor_value_info("x", F, [mib])],
                   [helper.make_tensor_value_info("c", F, [mib])], inits=[w])
    session = Session(model, device="cpu", numerics=None)
    plan = session.plan()
    sizes = {name: 1 << 20 for name in ("a", "b", "c")}
    peak, step = planned_peak(plan, sizes, resident=1 << 20, feeds={"x": 1 << 20})
    # step 0: w + x + a = 3 MiB; x released; step 1: w + a + b = 3 MiB; step 2: w + b + c
    assert peak == 3 << 20 and step == 0


def test_fitting_models_run_as_before(monkeypatch):
    monkeypatch.delenv(memory.ENV, raising=False)
    session = Session(outer_product_model(), device="cpu", numerics=None)
    a = np.arange(3, dtype=np.float32).reshape(3, 1)
    assert session.run({"a": a, "b": a.T})["s"] == pytest.approx(9.0)


def test_a_training_run_whose_planned_peak_exceeds_the_limit_is_refused_before_a_step(
        tmp_path, monkeypatch):
    from support.cli_runs import invoke, one_error_line
    from support.training_runs import wide_matmul
    model, data = wide_matmul(tmp_path)
    monkeypatch.setenv("GRAPHOPT_MEMORY_LIMIT", "9M")   # the data fits, the step does not
    result = invoke("run", model, "--data", data, "--loss", "mse", "--labels", "target",
                    "--steps", 2, "--batch-size", 1000, "-q", "-o", tmp_path / "out.onnx",
                    "--checkpoint", tmp_path / "ckpt")
    one_error_line(result, "planned peak memory", "exceeds the 9.0 MiB available",
                   "nothing was run")
    assert not (tmp_path / "out.onnx").exists()
    assert not (tmp_path / "ckpt" / "checkpoint.npz").exists()

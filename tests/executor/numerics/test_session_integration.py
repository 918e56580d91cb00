"""The FP16 policy reached through a Session: __backwardpass nodes run under the guard, the
env vars pick the implementation, MI200 flushing is emulated, denormals are counted."""
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from graphopt.executor import Session
from graphopt.executor.numerics import GEMM_ENV, Fp16Policy

from .helpers import SUBNORMAL

F16 = TensorProto.FLOAT16


def two_matmuls() -> onnx.ModelProto:
    """y_fwd = a @ b (forward), y_bwd = a @ b (marked backward): the same product twice."""
    fwd = helper.make_node("MatMul", ["a", "b"], ["y_fwd"], name="forward_mm")
    bwd = helper.make_node("MatMul", ["a", "b"], ["y_bwd"], name="backward_mm")
    bwd.attribute.append(helper.make_attribute("__backwardpass", 1))
    graph = helper.make_graph(
        [fwd, bwd], "g",
        [helper.make_tensor_value_info("a", F16, [1, 2]),
         helper.make_tensor_value_info("b", F16, [2, 1])],
        [helper.make_tensor_value_info("y_fwd", F16, [1, 1]),
         helper.make_tensor_value_info("y_bwd", F16, [1, 1])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


FEEDS = {"a": np.array([[SUBNORMAL, 1.0]], np.float16),
         "b": np.array([[1.0], [0.0]], np.float16)}


@pytest.mark.parametrize("env, forward_kept, backward_kept", [
    (None, False, True),   # unset: forward original (flushes), backward alternate
    ("1", True, True),     # alternate both
    ("0", False, False),   # original both
])
def test_mi200_session_follows_the_seed_table(monkeypatch, env, forward_kept, backward_kept):
    if env is not None:
        monkeypatch.setenv(GEMM_ENV, env)
    out = Session(two_matmuls(), device="cpu", numerics="mi200").run(FEEDS)
    assert bool(out["y_fwd"][0, 0] == SUBNORMAL) is forward_kept
    assert bool(out["y_bwd"][0, 0] == SUBNORMAL) is backward_kept
    if not forward_kept:
        assert out["y_fwd"][0, 0] == 0


def test_native_keeps_denormals_everywhere():
    out = Session(two_matmuls(), device="cpu", numerics="native").run(FEEDS)
    assert out["y_fwd"][0, 0] == SUBNORMAL and out["y_bwd"][0, 0] == SUBNORMAL


def test_programmatic_policy_overrides_the_environment(monkeypatch):
    monkeypatch.setenv(GEMM_ENV, "0")
    out = Session(two_matmuls(), device="cpu", numerics="mi200",
                  fp16_policy=Fp16Policy(gemm="alternate")).run(FEEDS)
    assert out["y_fwd"][0, 0] == SUBNORMAL and out["y_bwd"][0, 0] == SUBNORMAL


def test_denormal_report_splits_forward_and_backward():
    session = Session(two_matmuls(), device="cpu", numerics="mi200", denormal_stats=True)
    session.run(FEEDS)
    nodes = session.numerics.denormal_report()["nodes"]
    assert set(nodes) == {"forward_mm", "backward_mm"}
    assert nodes["forward_mm"]["forward"]["input_denormals"] == 1
    assert nodes["backward_mm"]["backward"]["input_denormals"] == 1


def test_unknown_numerics_mode_is_a_clear_error():
    from graphopt.executor.errors import ExecutorError

    with pytest.raises(ExecutorError, match="numerics must be"):
        Session(two_matmuls(), device="cpu", numerics="fast")

"""Session API: planning, plan-time and feed errors, intermediates, memory release, hooks."""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from graphopt.executor import (
    CupyNotInstalledError,
    DeviceUnavailableError,
    FeedError,
    InvalidModelError,
    Session,
    UnsupportedOpsError,
)
from graphopt.executor.backend import select_backend

from .helpers import MS


def _chain_model():
    """x -> Relu(t1) -> Mul by w (t2) -> Add x (t3) -> MatMul w2 -> y ; w, w2 initializers."""
    nodes = [
        helper.make_node("Relu", ["x"], ["t1"], name="relu"),
        helper.make_node("Mul", ["t1", "w"], ["t2"], name="mul"),
        helper.make_node("Add", ["t2", "x"], ["t3"], name="add"),
        helper.make_node("MatMul", ["t3", "w2"], ["y"], name="matmul"),
    ]
    w = numpy_helper.from_array(np.full((4,), 2.0, np.float32), "w")
    w2 = numpy_helper.from_array(np.eye(4, 3, dtype=np.float32), "w2")
    graph = helper.make_graph(
        nodes, "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 3])],
        initializer=[w, w2],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _expected(x):
    return ((np.maximum(x, 0) * 2 + x) @ np.eye(4, 3)).astype(np.float32)


def test_run_returns_outputs_by_name():
    x = np.random.default_rng(0).standard_normal((5, 4)).astype(np.float32)
    out = Session(_chain_model(), device="cpu").run({"x": x})
    assert list(out) == ["y"]
    np.testing.assert_allclose(out["y"], _expected(x), rtol=1e-6)


def test_any_intermediate_can_be_fetched_and_only_needed_nodes_run():
    x = np.random.default_rng(1).standard_normal((2, 4)).astype(np.float32)
    session = Session(_chain_model(), device="cpu")
    out = session.run({"x": x}, output_names=["t1", "t3"])
    np.testing.assert_array_equal(out["t1"], np.maximum(x, 0))
    np.testing.assert_allclose(out["t3"], np.maximum(x, 0) * 2 + x)
    assert [s.node.name for s in session.plan(["t1"]).steps] == ["relu"]


def test_unknown_fetch_is_an_error():
    with pytest.raises(InvalidModelError, match="nope"):
        Session(_chain_model(), device="cpu").run({"x": np.zeros((1, 4), np.float32)}, ["nope"])


def test_unsupported_ops_are_all_listed_at_plan_time_with_node_names():
    nodes = [
        helper.make_node("Relu", ["x"], ["a"], name="ok"),
        helper.make_node("FancyOp", ["a"], ["b"], name="first_bad"),
        helper.make_node("Loop2000", ["b"], ["c"], name="second_bad", domain=MS),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
        [helper.make_tensor_value_info("c", TensorProto.FLOAT, [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid(MS, 1)])
    with pytest.raises(UnsupportedOpsError) as info:
        Session(model, device="cpu")
    message = str(info.value)
    assert "first_bad" in message and "FancyOp" in message
    assert "second_bad" in message and "com.microsoft::Loop2000" in message
    assert "'ok'" not in message
    assert len(info.value.missing) == 2


def test_opset_range_matters_for_kernel_lookup():
    # Gelu exists in ai.onnx only from opset 20 on
    node = helper.make_node("Gelu", ["x"], ["y"], name="g")
    graph = helper.make_graph([node], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    with pytest.raises(UnsupportedOpsError, match="opset 17"):
        Session(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), device="cpu")
    Session(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)]), device="cpu")


@pytest.mark.parametrize(
    "feeds, match",
    [
        ({"x": np.zeros((2, 4), np.float32), "extra": np.zeros(1)}, "unknown feed name.*extra"),
        ({}, "missing feed.*'x'"),
        ({"x": np.zeros((2, 4), np.float64)}, "'x' has dtype float64.*float32"),
        ({"x": np.zeros((2, 5), np.float32)}, r"'x' has shape \(2, 5\).*axis 1 must be 4"),
        ({"x": np.zeros((2, 4, 1), np.float32)}, "'x'.*rank 3"),
    ],
)
def test_bad_feeds_raise_one_clear_error_before_anything_runs(feeds, match):
    session = Session(_chain_model(), device="cpu")
    ran = []
    with pytest.raises(FeedError, match=match):
        session.run(feeds, observer=lambda *args: ran.append(args))
    assert ran == []


def test_symbolic_dims_must_bind_consistently():
    graph = helper.make_graph(
        [helper.make_node("Add", ["a", "b"], ["c"], name="add")], "g",
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, ["n"]),
         helper.make_tensor_value_info("b", TensorProto.FLOAT, ["n"])],
        [helper.make_tensor_value_info("c", TensorProto.FLOAT, ["n"])])
    session = Session(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]),
                      device="cpu")
    with pytest.raises(FeedError, match="'n'"):
        session.run({"a": np.zeros(3, np.float32), "b": np.zeros(4, np.float32)})


def test_last_use_table_and_release_of_intermediates():
    session = Session(_chain_model(), device="cpu")
    plan = session.plan()
    order = [s.node.name for s in plan.steps]
    assert order == ["relu", "mul", "add", "matmul"]
    assert plan.last_use["t1"] == 1 and plan.last_use["t2"] == 2 and plan.last_use["x"] == 2
    assert plan.last_use["t3"] == 3

    live_per_step = []
    session.run({"x": np.ones((2, 4), np.float32)},
                observer=lambda i, name, live: live_per_step.append((name, set(live))))
    live = dict(live_per_step)
    assert "t1" in live["relu"] and "t1" not in live["mul"]
    assert "t2" not in live["add"] and "x" not in live["add"]
    assert live["matmul"] == {"y"}
    assert max(len(s) for s in live.values()) <= 4


def test_on_step_sees_each_steps_outputs_in_plan_order_as_they_are_produced():
    """The hook a caller acts through (no wrapping of plan steps): the step index and node
    of the plan, every output of the node (an unused one too), before later steps run."""
    session = Session(_chain_model(), device="cpu")
    x = np.arange(8, dtype=np.float32).reshape(2, 4) - 3
    seen = []

    def on_step(index, node, outputs):
        seen.append((index, node.name, [np.array(v) for v in outputs]))

    out = session.run({"x": x}, ["t2", "y"], on_step=on_step)
    plan = session.plan(["t2", "y"])
    assert [(i, name) for i, name, _ in seen] == [(i, s.node.name)
                                                 for i, s in enumerate(plan.steps)]
    values = {name: outputs for _, name, outputs in seen}
    np.testing.assert_array_equal(values["relu"][0], np.maximum(x, 0))
    np.testing.assert_array_equal(values["mul"][0], out["t2"])
    np.testing.assert_array_equal(values["matmul"][0], out["y"])

    split = helper.make_model(helper.make_graph(
        [helper.make_node("Split", ["x"], ["a", "b"], name="split", axis=1),
         helper.make_node("Neg", ["a"], ["y"], name="neg")], "split",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 2])]),
        opset_imports=[helper.make_opsetid("", 13)])
    seen.clear()
    Session(split, device="cpu").run({"x": x}, on_step=on_step)
    (_, first, (a, b)), (_, second, (y,)) = seen
    assert (first, second) == ("split", "neg")
    np.testing.assert_array_equal(b, x[:, 2:])   # "b" is used by nothing, still reported
    np.testing.assert_array_equal(y, -x[:, :2])


def test_what_on_step_raises_stops_the_run_unchanged():
    session = Session(_chain_model(), device="cpu")
    steps = []

    def on_step(index, node, outputs):
        steps.append(node.name)
        if node.name == "mul":
            raise LookupError("stop here")

    with pytest.raises(LookupError, match="stop here"):
        session.run({"x": np.ones((2, 4), np.float32)}, on_step=on_step)
    assert steps == ["relu", "mul"]


def test_cycle_is_reported():
    nodes = [helper.make_node("Relu", ["b"], ["a"], name="r1"),
             helper.make_node("Relu", ["a"], ["b"], name="r2")]
    graph = helper.make_graph(nodes, "g", [],
                              [helper.make_tensor_value_info("b", TensorProto.FLOAT, [1])])
    with pytest.raises(InvalidModelError, match="cycle"):
        Session(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), device="cpu")


def test_path_loading(tmp_path):
    import onnx

    path = tmp_path / "m.onnx"
    onnx.save(_chain_model(), path)
    x = np.ones((1, 4), np.float32)
    np.testing.assert_allclose(Session(str(path), device="cpu").run({"x": x})["y"], _expected(x))


class _RecordingNumerics:
    """Stands in for the FP16 policy object: records what the session tells it."""

    def __init__(self):
        self.current_node = None
        self.in_backward = False
        self.calls = []

    def matmul(self, a, b, op="gemm"):
        self.calls.append((self.current_node, op, self.in_backward))
        return np.matmul(a, b)

    @contextlib.contextmanager
    def backward_pass(self):
        previous, self.in_backward = self.in_backward, True
        try:
            yield
        finally:
            self.in_backward = previous


def test_numerics_sees_every_gemm_with_node_name_and_backward_flag():
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["h"], name="fwd_mm"),
        helper.make_node("Conv", ["img", "k"], ["c"], name="fwd_conv"),
        helper.make_node("FusedMatMul", ["h", "w"], ["g"], name="bwd_mm", domain=MS,
                         transB=1, __backwardpass=1),
    ]
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3]),
         helper.make_tensor_value_info("w", TensorProto.FLOAT, [3, 3]),
         helper.make_tensor_value_info("img", TensorProto.FLOAT, [1, 1, 4, 4]),
         helper.make_tensor_value_info("k", TensorProto.FLOAT, [2, 1, 3, 3])],
        [helper.make_tensor_value_info("g", TensorProto.FLOAT, None),
         helper.make_tensor_value_info("c", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid(MS, 1)])
    numerics = _RecordingNumerics()
    rng = np.random.default_rng(0)
    feeds = {"x": rng.random((2, 3), np.float32), "w": rng.random((3, 3), np.float32),
             "img": rng.random((1, 1, 4, 4), np.float32), "k": rng.random((2, 1, 3, 3), np.float32)}
    out = Session(model, device="cpu", numerics=numerics).run(feeds)
    assert sorted(numerics.calls) == sorted([
        ("fwd_mm", "gemm", False), ("fwd_conv", "conv_fwd", False), ("bwd_mm", "gemm", True)])
    plain = Session(model, device="cpu").run(feeds)
    np.testing.assert_allclose(out["g"], plain["g"], rtol=1e-6)


def test_device_selection():
    assert select_backend("cpu").xp is np
    assert select_backend("auto").device in ("cpu", "cuda", "rocm")
    with pytest.raises(DeviceUnavailableError, match="unknown device"):
        select_backend("tpu")
    try:
        import cupy  # noqa: F401
    except ImportError:
        for device in ("cuda", "rocm"):
            with pytest.raises(CupyNotInstalledError, match="CuPy is not installed"):
                Session(_chain_model(), device=device)
        assert Session(_chain_model(), device="auto").device == "cpu"


def test_dropout_training_mode_mask_and_scale():
    x = np.ones((200, 50), np.float32)
    model = helper.make_model(helper.make_graph(
        [helper.make_node("Dropout", ["x", "r", "t"], ["y", "m"], name="d", seed=3)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [200, 50])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None),
         helper.make_tensor_value_info("m", TensorProto.BOOL, None)],
        initializer=[numpy_helper.from_array(np.array(0.25, np.float32), "r"),
                     numpy_helper.from_array(np.array(True), "t")]),
        opset_imports=[helper.make_opsetid("", 17)])
    out = Session(model, device="cpu").run({"x": x})
    mask = out["m"]
    assert mask.dtype == np.bool_ and 0.7 < mask.mean() < 0.8
    np.testing.assert_allclose(out["y"], np.where(mask, 1 / 0.75, 0).astype(np.float32), rtol=1e-6)
    again = Session(model, device="cpu").run({"x": x})["m"]
    np.testing.assert_array_equal(mask, again)  # the node seed makes it reproducible


def test_supported_ops_table_lists_registry():
    from graphopt.executor import supported_ops_markdown

    table = supported_ops_markdown()
    assert "| com.microsoft | FusedMatMul | 1+ | yes |" in table
    assert "| ai.onnx | Softmax | 1-12, 13+ |  |" in table

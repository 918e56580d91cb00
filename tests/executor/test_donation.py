"""Session.run lets in-place kernels write into an input that dies at their node.
Only arrays nothing else can see may be overwritten: not a feed, an initializer, a fetched
tensor, nor the base of a view that is still live."""

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from graphopt.executor import Session


def _model(nodes, outputs):
    inits = [numpy_helper.from_array(np.array(2.0, np.float32), "two"),
             numpy_helper.from_array(np.array([4, 3], np.int64), "shape43"),
             numpy_helper.from_array(np.array([3, 4], np.int64), "shape34")]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4])],
        [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_a_live_view_keeps_its_base_from_being_overwritten():
    nodes = [
        helper.make_node("Mul", ["x", "two"], ["a"]),            # a = 2x, a fresh array
        helper.make_node("Reshape", ["a", "shape43"], ["r"]),    # r: a view of a, still live
        helper.make_node("Add", ["a", "two"], ["b"]),            # a's last use
        helper.make_node("Reshape", ["r", "shape34"], ["r2"]),
        helper.make_node("Mul", ["r2", "b"], ["c"]),             # reads a's memory through r
        helper.make_node("Softmax", ["c"], ["d"], axis=-1),
        helper.make_node("Sub", ["d", "x"], ["e"]),
    ]
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    before = x.copy()
    out = Session(_model(nodes, ["e", "b"]), device="cpu").run({"x": x})
    a = 2 * before
    c = a * (a + 2)
    d = np.exp(c - c.max(-1, keepdims=True))
    d /= d.sum(-1, keepdims=True)
    np.testing.assert_allclose(out["b"], a + 2, rtol=1e-6)
    np.testing.assert_allclose(out["e"], d - before, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(x, before)  # the feed is never written


def test_fetched_and_repeated_inputs_are_not_overwritten():
    nodes = [
        helper.make_node("Mul", ["x", "two"], ["a"]),
        helper.make_node("Add", ["a", "a"], ["b"]),   # the same tensor twice
        helper.make_node("Mul", ["b", "two"], ["c"]),  # b is fetched as well
    ]
    x = np.ones((3, 4), np.float32)
    session = Session(_model(nodes, ["c", "b"]), device="cpu")
    for _ in range(2):  # the second run must see the same initializers
        out = session.run({"x": x})
        np.testing.assert_array_equal(out["b"], np.full((3, 4), 4.0, np.float32))
        np.testing.assert_array_equal(out["c"], np.full((3, 4), 8.0, np.float32))


def test_donation_happens_for_a_dying_intermediate():
    nodes = [helper.make_node("Mul", ["x", "two"], ["a"]),
             helper.make_node("Add", ["a", "two"], ["b"])]
    session = Session(_model(nodes, ["b"]), device="cpu")
    seen = []
    kernel = session.plan().steps[1].fn

    def spy(ctx, node, a, b):
        seen.append(any(a is d for d in ctx.donated))
        return kernel(ctx, node, a, b)

    session.plan().steps[1].fn = spy
    out = session.run({"x": np.ones((3, 4), np.float32)})
    np.testing.assert_array_equal(out["b"], np.full((3, 4), 4.0, np.float32))
    assert seen == [True]


def test_a_dying_view_whose_owner_nothing_else_holds_is_donated():
    # attention scores are a transposed view of the GEMM's output: Softmax may overwrite them
    nodes = [helper.make_node("Mul", ["x", "two"], ["a"]),
             helper.make_node("Transpose", ["a"], ["t"], perm=[1, 0]),   # t: a view of a
             helper.make_node("Softmax", ["t"], ["s"], axis=-1)]
    session = Session(_model(nodes, ["s"]), device="cpu")
    seen = []
    kernel = session.plan().steps[2].fn

    def spy(ctx, node, t):
        seen.append(any(t is d for d in ctx.donated))
        return kernel(ctx, node, t)

    session.plan().steps[2].fn = spy
    x = np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)
    out = session.run({"x": x})
    e = np.exp(2 * x.T - (2 * x.T).max(-1, keepdims=True))
    np.testing.assert_allclose(out["s"], e / e.sum(-1, keepdims=True), rtol=1e-6)
    assert seen == [True]

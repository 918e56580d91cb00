"""The gradient reducer in one process (no MPI): through ``Session.run(on_step=...)`` a bucket's
all-reduce starts right after the step that produces its last gradient, while later steps
still run; what no step produced is filled after the run; nothing in the session's plan is
changed."""
from __future__ import annotations

from types import SimpleNamespace

import numpy as np
from onnx import TensorProto, helper

from graphopt.executor import Session
from graphopt.trainer.distributed import GradientReducer

EVENTS: list[tuple] = []
FETCHES = ["loss", "ga", "gb", "gc"]


class RecordingTransport:
    """Host buckets like MpiTransport's; says when each all-reduce starts; 'sums' over one
    rank (the buffer stays as it is)."""

    name = "recording"

    def buffer(self, size, dtype=np.float32):
        return np.zeros(size, np.float32)

    def stage(self, buffer, offset, value):
        flat = np.asarray(value, np.float32).reshape(-1)
        buffer[offset:offset + flat.size] = flat

    def start(self, buffer):
        EVENTS.append(("start", buffer.size))
        return buffer.size

    def done(self, handles):
        return True

    def poke(self, handles):
        EVENTS.append(("poke", tuple(handles)))
        return True

    def finish(self, buffer, divisor):
        buffer /= np.float32(divisor)
        return buffer, bool(np.isfinite(buffer).all())


class OneRank:
    rank, size, timeout = 0, 1, 30.0

    def wait(self, done, step, what, timeout=None):
        assert done(), what


def _chain():
    """x -> ga = x*2 (grad of a, 3 floats) -> h = Relu(ga) -> gb = h+1 (grad of b) -> loss;
    gc (grad of c) is a graph input: no step produces it."""
    nodes = [helper.make_node("Add", ["x", "x"], ["ga"], name="grad_a"),
             helper.make_node("Relu", ["ga"], ["h"], name="relu"),
             helper.make_node("Add", ["h", "one"], ["gb"], name="grad_b"),
             helper.make_node("ReduceSum", ["gb"], ["loss"], name="loss", keepdims=0)]
    one = helper.make_tensor("one", TensorProto.FLOAT, [], [1.0])
    graph = helper.make_graph(
        nodes, "chain",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [3]) for n in ("x", "gc")],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, None)
         for n in ("loss", "ga", "gb", "gc")], initializer=[one])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _reducer(session, bucket_bytes, overlap=True):
    grads = {"a": "ga", "b": "gb", "c": "gc"}
    trainer = SimpleNamespace(
        graph=SimpleNamespace(params=list(grads), grads=grads), session=session,
        fetches=FETCHES,
        params={p: np.zeros(3, np.float32) for p in grads})
    return GradientReducer(trainer, OneRank(), RecordingTransport(), bucket_bytes, overlap)


def _run(session, reducer, feeds):
    def on_step(index, node, outputs):
        EVENTS.append(("step", node.name))
        if reducer.step_hook is not None:
            reducer.step_hook(index, node, outputs)

    EVENTS.clear()
    reducer.begin()
    try:
        out = session.run(feeds, FETCHES, on_step=on_step)
    finally:
        reducer.end()
    reducer.finish(out, 1)
    return out


def test_each_bucket_starts_right_after_its_last_gradient_is_produced():
    session = Session(_chain(), device="cpu")
    functions = [step.fn for step in session.plan(FETCHES).steps]
    reducer = _reducer(session, bucket_bytes=12)   # one 3-float gradient per bucket
    x = np.array([-1.0, 0.5, 2.0], np.float32)
    gc = np.array([4.0, 5.0, 6.0], np.float32)
    out = _run(session, reducer, {"x": x, "gc": gc})
    assert [b.params for b in reducer.buckets] == [["a"], ["b"], ["c"]]
    assert EVENTS == [("step", "grad_a"), ("start", 3), ("poke", (3,)),
                      ("step", "relu"), ("poke", (3,)),
                      ("step", "grad_b"), ("start", 3), ("poke", (3, 3)),
                      ("step", "loss"), ("poke", (3, 3)),
                      ("start", 3)]   # gc: no step produces it, it goes after the run
    assert (reducer.launched, reducer.launched_in_backward) == (3, 2)
    grads, finite = reducer.gradients(2.0)
    assert finite
    np.testing.assert_array_equal(grads["a"], 2 * x / 2)
    np.testing.assert_array_equal(grads["b"], (np.maximum(2 * x, 0) + 1) / 2)
    np.testing.assert_array_equal(grads["c"], gc / 2)
    np.testing.assert_array_equal(out["ga"], 2 * x)
    # the plan's steps are the session's, untouched
    assert [step.fn for step in session.plan(FETCHES).steps] == functions


def test_without_overlap_every_bucket_starts_after_the_run():
    session = Session(_chain(), device="cpu")
    reducer = _reducer(session, bucket_bytes=12, overlap=False)
    assert reducer.step_hook is None
    x = np.array([1.0, 2.0, 3.0], np.float32)
    _run(session, reducer, {"x": x, "gc": x})
    assert [e for e in EVENTS if e[0] != "step"] == [("start", 3)] * 3
    assert (reducer.launched, reducer.launched_in_backward) == (3, 0)
    grads, _ = reducer.gradients(1.0)
    np.testing.assert_array_equal(grads["b"], 2 * x + 1)

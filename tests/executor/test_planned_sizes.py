"""The memory plan sizes every tensor of a training step exactly: the shapes computed from
the data's shape (Shape -> Gather -> Concat -> Reshape, the gradients' BroadcastGradientArgs
axes) are computed at plan time from the feeds' shapes, so the planned peak a run prints and
the guard checks counts what the step really allocates."""
from __future__ import annotations

import pytest

from graphopt.executor import Session
from graphopt.trainer.training_graph import build


@pytest.mark.parametrize("example", ["mqa", "mlp-digits"])
def test_every_tensor_of_a_training_step_is_sized_exactly_by_the_plan(example):
    from graphopt.examples import load_example

    loaded = load_example(example)
    settings = loaded.settings
    arrays = {k: v[:8] for k, v in loaded.data.items()}
    graph = build(loaded.model, loss=settings.get("loss"), labels=settings.get("labels"),
                  label_shapes={k: v.shape for k, v in arrays.items()})
    session = Session(graph.proto, device="cpu", training=True, fed=graph.params)
    feeds = {**{n: arrays[n] for n in graph.data_inputs}, **graph.initial}
    fetches = list(graph.losses) + [graph.grads[p] for p in graph.params]
    made: dict[str, int] = {}

    def record(_index, node, outputs):
        for name, value in zip(node.outputs, outputs, strict=False):
            if name and hasattr(value, "nbytes"):
                made[name] = int(value.nbytes)

    session.run(feeds, fetches, on_step=record)
    guard = session._memory
    shapes = {n: tuple(v.shape) for n, v in feeds.items()}
    sizes = guard._sizes_for(shapes, ("test",))
    wrong = {n: (sizes.get(n), b) for n, b in made.items() if sizes.get(n) != b}
    assert not wrong, list(wrong.items())[:5]
    peak, node = session.planned_peak(feeds, fetches)
    assert node is not None and peak > sum(v.nbytes for v in graph.initial.values())

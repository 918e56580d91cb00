"""Forward ONNX model -> ONNX Runtime-style training graph (forward, YieldOp, gradients).

    from graphopt.training import build_training_graph
    training = build_training_graph(model, loss="cross_entropy", freeze=["embed.*"])
    training.proto, training.params, training.grads   # the graph and what it trains

A :class:`TrainingGraph` records what it trains in the model's metadata, so a saved one
reads back with :meth:`TrainingGraph.from_model`.

Gradients are declared per op type in :mod:`graphopt.training.gradients`; add one with::

    from graphopt.training import gradient

    @gradient("Softplus")
    def softplus(ctx):
        return [ctx.op("Mul", ctx.dy, ctx.op("Sigmoid", ctx.input(0)))]
"""
from .builder import build_training_graph
from .graph import TrainingGraph
from .registry import GRADIENTS, GradientContext, gradient

__all__ = ["build_training_graph", "TrainingGraph", "gradient", "GradientContext", "GRADIENTS"]

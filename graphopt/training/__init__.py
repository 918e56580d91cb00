"""Forward ONNX model -> ONNX Runtime-style training graph (forward, YieldOp, gradients).

    from graphopt.training import build_training_graph
    training = build_training_graph(model, loss="cross_entropy", freeze=["embed.*"])

Gradients are declared per op type in :mod:`graphopt.training.gradients`; add one with::

    from graphopt.training import gradient

    @gradient("Softplus")
    def softplus(ctx):
        return [ctx.op("Mul", ctx.dy, ctx.op("Sigmoid", ctx.input(0)))]
"""
from .builder import build_training_graph
from .registry import GRADIENTS, GradientContext, gradient

__all__ = ["build_training_graph", "gradient", "GradientContext", "GRADIENTS"]

"""The tanh approximation of GELU, 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3))), as
GPT-2's, CodeGen's and BLOOM's Python write it and PyTorch exports it -> one com.microsoft
FastGelu (ONNX Runtime's FastGeluFusion).

The cube is Pow(x, 3), x * (x * x) or (x * x) * x; the inner product is either
sqrt(2/pi) * (x + 0.044715 * x^3) or, as BLOOM writes it, (sqrt(2/pi) * x) *
(1 + 0.044715 * x * x); the outer 0.5 * x * (1 + tanh) in any grouping. Training applies it
before differentiation (FastGelu -> FastGeluGrad), like gelu_fusion."""
from __future__ import annotations

import math

from graphopt.dsl import BEFORE_DIFFERENTIATION, Rule, one_of, op, var
from graphopt.vocabulary import MS_DOMAIN

from ._activation_fusion import (
    float_input,
    formula_constant,
    inner_nodes_feed_only_the_pattern,
    keeps_rank,
)

x = var("x")
one = formula_constant("one", 1.0, "1")
half = formula_constant("half", 0.5, "0.5")
slope = formula_constant("slope", math.sqrt(2.0 / math.pi), "sqrt(2/pi)")
cubic = formula_constant("cubic", 0.044715, "0.044715")
three = formula_constant("three", 3.0, "3")
CONSTANTS = ("one", "half", "slope", "cubic", "three")


def _cubes():
    yield op.Pow(x, three)
    yield op.Mul(x, op.Mul(x, x))  # Mul is commutative: (x * x) * x too


def _tanh_arguments():
    for cube in _cubes():
        yield op.Mul(op.Add(x, op.Mul(cube, cubic)), slope)  # sqrt(2/pi) * (x + k x^3)
    for square in (op.Mul(op.Mul(x, cubic), x), op.Mul(op.Mul(x, x), cubic)):
        yield op.Mul(op.Mul(x, slope), op.Add(square, one))  # (sqrt(2/pi) x) (1 + k x^2)


def _alternatives():
    for argument in _tanh_arguments():
        shifted = op.Add(op.Tanh(argument), one)
        yield op.Mul(op.Mul(x, shifted), half)  # (x * (1 + tanh)) * 0.5
        yield op.Mul(op.Mul(x, half), shifted)  # (x * 0.5) * (1 + tanh)
        yield op.Mul(x, op.Mul(shifted, half))  # x * ((1 + tanh) * 0.5)


def to_fast_gelu(m):
    return op.ms.FastGelu(m.x)


RULE = Rule(
    name="fast_gelu_fusion",
    description="0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3))) -> com.microsoft "
                "FastGelu",
    level=2,
    tags=("fusion", MS_DOMAIN, BEFORE_DIFFERENTIATION),
    match=one_of(*_alternatives()),
    where=[float_input, keeps_rank(*CONSTANTS), inner_nodes_feed_only_the_pattern],
    rewrite=to_fast_gelu,
)

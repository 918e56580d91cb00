"""The tanh approximation of GELU, 0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 * x^3))), as
GPT-2's, CodeGen's and BLOOM's Python write it and PyTorch exports it -> one com.microsoft
FastGelu (ONNX Runtime's FastGeluFusion).

The outer 0.5 * x * (1 + tanh(t)) is the pattern, in any grouping; t must be the GELU cubic
of the same x: sqrt(2/pi) * (x + 0.044715 * x^3), the cube as Pow(x, 3) or two Muls, or as
BLOOM writes it, (sqrt(2/pi) * x) * (1 + 0.044715 * x * x). t is checked as a sub-pattern
(produced_by): inside the pattern, under three commutative ops, its matcher would be
generated eight times over. Training applies the rule before differentiation (FastGelu ->
FastGeluGrad), like gelu_fusion."""
from __future__ import annotations

import math

from graphopt.dsl import BEFORE_DIFFERENTIATION, Rule, one_of, op, var
from graphopt.vocabulary import MS_DOMAIN

from ._activation_fusion import constraints, formula_constant, half_x_times_one_plus, one, x

t = var("t")
slope = formula_constant("slope", math.sqrt(2.0 / math.pi), "sqrt(2/pi)")
cubic = formula_constant("cubic", 0.044715, "0.044715")
three = formula_constant("three", 3.0, "3")


def _cubes():
    yield op.Pow(x, three)
    yield op.Mul(x, op.Mul(x, x))  # Mul is commutative: (x * x) * x too


def _cubic_forms():
    for cube in _cubes():
        yield op.Mul(op.Add(x, op.Mul(cube, cubic)), slope)  # sqrt(2/pi) * (x + k x^3)
    for square in (op.Mul(op.Mul(x, cubic), x), op.Mul(op.Mul(x, x), cubic)):
        yield op.Mul(op.Mul(x, slope), op.Add(square, one))  # (sqrt(2/pi) x) (1 + k x^2)


GELU_CUBIC = one_of(*_cubic_forms())


def to_fast_gelu(m):
    return op.ms.FastGelu(m.x)


RULE = Rule(
    name="fast_gelu_fusion",
    description="0.5 * x * (1 + tanh(sqrt(2/pi) * (x + 0.044715 x^3))) -> com.microsoft "
                "FastGelu",
    level=2,
    tags=("fusion", MS_DOMAIN, BEFORE_DIFFERENTIATION),
    match=half_x_times_one_plus(op.Tanh(t)),
    where=constraints("t", GELU_CUBIC, "sqrt(2/pi) * (x + 0.044715 * x^3)"),
    rewrite=to_fast_gelu,
)

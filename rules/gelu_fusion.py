"""x * 0.5 * (1 + erf(x / sqrt(2))), as exporters write exact GELU (Div or Mul by 1/sqrt(2),
Erf, Add 1, two Muls in any of their three groupings) -> one com.microsoft Gelu.

The training graph builder differentiates Gelu (GeluGrad), so the trainer applies this rule
to the forward graph before differentiation: one forward and one backward node instead of
five forward and a dozen backward ones (as ONNX Runtime's pre-training GeluFusion does)."""
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


def _alternatives():
    for scaled in (op.Div(x, formula_constant("sqrt2", math.sqrt(2.0), "sqrt(2)")),
                   op.Mul(x, formula_constant("inv_sqrt2", math.sqrt(0.5), "1/sqrt(2)"))):
        shifted = op.Add(op.Erf(scaled), one)
        yield op.Mul(op.Mul(x, shifted), half)  # (x * (1 + erf)) * 0.5
        yield op.Mul(op.Mul(x, half), shifted)  # (x * 0.5) * (1 + erf)
        yield op.Mul(x, op.Mul(shifted, half))  # x * ((1 + erf) * 0.5)


def to_gelu(m):
    return op.ms.Gelu(m.x)


RULE = Rule(
    name="gelu_fusion",
    description="x * 0.5 * (1 + erf(x / sqrt(2))) (Div/Mul, Erf, Add, Mul, Mul) -> "
                "com.microsoft Gelu",
    level=2,
    tags=("fusion", MS_DOMAIN, BEFORE_DIFFERENTIATION),
    match=one_of(*_alternatives()),
    where=[float_input, keeps_rank("sqrt2", "inv_sqrt2", "one", "half"),
           inner_nodes_feed_only_the_pattern],
    rewrite=to_gelu,
)

"""x * 0.5 * (1 + erf(x / sqrt(2))), as exporters write exact GELU (Div or Mul by 1/sqrt(2),
Erf, Add 1, two Muls in any of their three groupings) -> one com.microsoft Gelu. The outer
product is the pattern; the Erf's argument, x / sqrt(2) of the same x, a sub-pattern.

The training graph builder differentiates Gelu (GeluGrad), so the trainer applies this rule
to the forward graph before differentiation: one forward and one backward node instead of
five forward and a dozen backward ones (as ONNX Runtime's pre-training GeluFusion does)."""
from __future__ import annotations

import math

from graphopt.dsl import BEFORE_DIFFERENTIATION, Rule, one_of, op, var
from graphopt.vocabulary import MS_DOMAIN

from ._activation_fusion import constraints, formula_constant, half_x_times_one_plus, x

s = var("s")
# x / sqrt(2), as a sub-pattern (produced_by): under the pattern's commutative ops its
# matcher would be generated four times over
SCALED = one_of(op.Div(x, formula_constant("sqrt2", math.sqrt(2.0), "sqrt(2)")),
                op.Mul(x, formula_constant("inv_sqrt2", math.sqrt(0.5), "1/sqrt(2)")))


def to_gelu(m):
    return op.ms.Gelu(m.x)


RULE = Rule(
    name="gelu_fusion",
    description="x * 0.5 * (1 + erf(x / sqrt(2))) (Div/Mul, Erf, Add, Mul, Mul) -> "
                "com.microsoft Gelu",
    level=2,
    tags=("fusion", MS_DOMAIN, BEFORE_DIFFERENTIATION),
    match=half_x_times_one_plus(op.Erf(s)),
    where=constraints("s", SCALED, "x / sqrt(2)"),
    rewrite=to_gelu,
)

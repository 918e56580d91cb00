"""x * 0.5 * (1 + erf(x / sqrt(2))), as exporters write exact GELU (Div or Mul by 1/sqrt(2),
Erf, Add 1, two Muls in any of their three groupings) -> one com.microsoft Gelu.

The training graph builder differentiates Gelu (GeluGrad), so the trainer applies this rule
to the forward graph before differentiation: one forward and one backward node instead of
five forward and a dozen backward ones (as ONNX Runtime's pre-training GeluFusion does)."""
from __future__ import annotations

import math

import numpy as np
from onnx import TensorProto

from graphopt.dsl import (
    BEFORE_DIFFERENTIATION,
    Rule,
    one_of,
    op,
    scalar_const,
    single_consumer,
    var,
)
from graphopt.vocabulary import MS_DOMAIN

# com.microsoft Gelu's types (ONNX Runtime's GeluFusion checks the same)
GELU_TYPES = (np.float16, np.float32, np.float64)
GELU_ELEM_TYPES = frozenset({TensorProto.FLOAT16, TensorProto.FLOAT, TensorProto.DOUBLE})

x = var("x")


def _near(expected: float):
    """A scalar float constant equal to ``expected`` up to its own type's rounding."""
    def predicate(value) -> bool:
        if value.size != 1 or value.ndim > 1 or value.dtype.type not in GELU_TYPES:
            return False
        tolerance = float(np.finfo(value.dtype).eps) * abs(expected)
        return abs(float(value.reshape(())) - expected) <= tolerance
    return predicate


def _constant(name: str, expected: float, shown: str):
    return scalar_const(name, _near(expected), f"{name} is not {shown} (a float scalar)")


def _alternatives():
    for scaled in (op.Div(x, _constant("sqrt2", math.sqrt(2.0), "sqrt(2)"), _name="scaled"),
                   op.Mul(x, _constant("inv_sqrt2", math.sqrt(0.5), "1/sqrt(2)"),
                          _name="scaled")):
        shifted = op.Add(op.Erf(scaled, _name="erf"), _constant("one", 1.0, "1"),
                         _name="shifted")
        half = _constant("half", 0.5, "0.5")
        yield op.Mul(op.Mul(x, shifted, _name="inner"), half)  # (x * (1 + erf)) * 0.5
        yield op.Mul(op.Mul(x, half, _name="inner"), shifted)  # (x * 0.5) * (1 + erf)
        yield op.Mul(x, op.Mul(shifted, half, _name="inner"))  # x * ((1 + erf) * 0.5)


def _gelu_type(m):
    elem = m.graph.elem_type(m.x.name, True)
    if elem is None:
        return "element type of x is unknown"
    return elem in GELU_ELEM_TYPES or f"x has element type {elem}, not float16/32/64"


def _keeps_shape(m):
    # x * [1]-shaped constants broadcast a rank-0 x to rank 1; Gelu(x) keeps rank 0
    if all(getattr(m, c).value.ndim == 0 for c in ("one", "half") + _scale_names(m)):
        return True
    shape = m.graph.static_shape(m.x.name)
    if shape is None:
        return "rank of x is unknown and a constant has rank 1"
    return len(shape) >= 1 or "a rank-1 constant would broadcast a rank-0 x to rank 1"


def _scale_names(m) -> tuple[str, ...]:
    return ("sqrt2",) if m.scaled.op_type == "Div" else ("inv_sqrt2",)


def _intermediates_feed_only_this(m):
    # every node but the last must go with the fusion, or GELU's pieces would be computed
    # twice (and in a training graph a forward node would leave the YieldOp's ancestry)
    for node in ("scaled", "erf", "shifted", "inner"):
        verdict = single_consumer(node)(m)
        if verdict is not True:
            return verdict
    return True


def to_gelu(m):
    return op.ms.Gelu(m.x)


RULE = Rule(
    name="gelu_fusion",
    description="x * 0.5 * (1 + erf(x / sqrt(2))) (Div/Mul, Erf, Add, Mul, Mul) -> "
                "com.microsoft Gelu",
    level=2,
    tags=("fusion", MS_DOMAIN, BEFORE_DIFFERENTIATION),
    match=one_of(*_alternatives()),
    where=[_gelu_type, _keeps_shape, _intermediates_feed_only_this],
    rewrite=to_gelu,
)

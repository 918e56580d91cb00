"""What the activation fusions (gelu_fusion, fast_gelu_fusion) share: the pattern x * 0.5 *
(1 + f(argument)), constants that must equal the formula's up to their own type's rounding,
and the checks that the fused node is a drop-in for the subgraph it replaces."""
from __future__ import annotations

import numpy as np
from onnx import TensorProto

from graphopt.dsl import (
    inner_nodes_read_only_by_match,
    one_of,
    op,
    produced_by,
    scalar_const,
    var,
)

# the types of com.microsoft Gelu and FastGelu (ONNX Runtime's fusions check the same)
FUSED_TYPES = (np.float16, np.float32, np.float64)
FUSED_ELEM_TYPES = frozenset({TensorProto.FLOAT16, TensorProto.FLOAT, TensorProto.DOUBLE})


def formula_constant(name: str, expected: float, shown: str):
    """A scalar constant (rank 0 or [1]) equal to ``expected`` up to its own type's rounding:
    float16's sqrt(2) (1.4140625) is the formula's, a float32 one in a float64 graph is not.
    An integer type counts when the value is exact (Pow's exponent 3)."""
    def predicate(value) -> bool:
        if value.size != 1 or value.ndim > 1:
            return False
        if value.dtype.type in FUSED_TYPES:
            tolerance = float(np.finfo(value.dtype).eps) * abs(expected)
        elif value.dtype.kind in "iu":
            tolerance = 0.0
        else:
            return False
        return abs(float(value.reshape(())) - expected) <= tolerance
    return scalar_const(name, predicate, f"{name} is not {shown} (a scalar)")


def float_input(m):
    elem = m.graph.elem_type(m.x.name, True)
    if elem is None:
        return "element type of x is unknown"
    return elem in FUSED_ELEM_TYPES or f"x has element type {elem}, not float16/32/64"


x = var("x")
one = formula_constant("one", 1.0, "1")
half = formula_constant("half", 0.5, "0.5")


def half_x_times_one_plus(activation):
    """The pattern x * 0.5 * (1 + activation), in the three groupings of its Muls (each
    Mul's operand order is the matcher's: Mul is commutative)."""
    shifted = op.Add(activation, one)
    return one_of(op.Mul(op.Mul(x, shifted), half),  # (x * (1 + f)) * 0.5
                  op.Mul(op.Mul(x, half), shifted),  # (x * 0.5) * (1 + f)
                  op.Mul(x, op.Mul(shifted, half)))  # x * ((1 + f) * 0.5)


def constraints(argument: str, computed_by, what: str) -> list:
    """The ``where`` of a fusion matched by half_x_times_one_plus(f(argument)): float x, the
    rank kept, every node of the match and of the argument's sub-pattern ``computed_by`` (of
    the same x) read only by the fusion (else the fused node would compute their part a
    second time and, in a training graph, take a forward node out of the YieldOp's
    ancestry)."""
    return [float_input, _keeps_rank(argument, what), inner_nodes_read_only_by_match(),
            produced_by(argument, computed_by, shared=("x",), what=what)]


def _keeps_rank(argument: str, what: str):
    """x times [1]-shaped constants is rank 1 for a rank-0 x, while the fused node keeps
    rank 0: a rank-1 0.5 or 1 needs x of rank >= 1, and so does the argument's sub-pattern
    (its own constants may be [1]-shaped) unless it has x's rank."""
    def constraint(m):
        x_shape = m.graph.static_shape(m.x.name)
        if x_shape is not None and len(x_shape) >= 1:
            return True
        if any(c.value is not None and c.value.ndim for c in (m.one, m.half)):
            if x_shape is None:
                return "rank of x is unknown and a constant has rank 1"
            return "a rank-1 constant would broadcast a rank-0 x to rank 1"
        if x_shape is not None and m.graph.static_shape(getattr(m, argument).name) == x_shape:
            return True
        return f"x is not known to be of rank >= 1, nor {what} of x's rank"
    return constraint

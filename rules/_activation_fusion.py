"""What the activation fusions (gelu_fusion, fast_gelu_fusion) share: their constants, which
must equal the formula's up to their own type's rounding, and the checks that the fused node
is a drop-in for the subgraph it replaces."""
from __future__ import annotations

import numpy as np
from onnx import TensorProto

from graphopt.dsl import op, scalar_const

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


def keeps_rank(*constants: str):
    """A constraint: x times [1]-shaped constants is rank 1 for a rank-0 x, while the fused
    node keeps rank 0; so a rank-1 constant (of these names, those the match bound) needs x
    of rank >= 1."""
    def constraint(m):
        values = [m.get(name) for name in constants]
        if all(v is None or v.value is None or v.value.ndim == 0 for v in values):
            return True
        shape = m.graph.static_shape(m.x.name)
        if shape is None:
            return "rank of x is unknown and a constant has rank 1"
        return len(shape) >= 1 or "a rank-1 constant would broadcast a rank-0 x to rank 1"
    return constraint


def inner_nodes_feed_only_the_pattern(m):
    """Every matched node but the last is read only by matched nodes (and is no graph
    output): the fusion then removes them all, instead of computing their part twice (and,
    in a training graph, taking a forward node out of the YieldOp's ancestry)."""
    graph, matched = m.graph, set(m.nodes)
    for node_id in matched.difference(m.roots):
        for out in graph.node(node_id).output:
            if graph.is_output(out) or not matched.issuperset(graph.consumers_of(out)):
                return (f"output {out!r} of a {graph.node(node_id).op_type} in the pattern "
                        "has other consumers")
    return True


def halved_products(x, shifted, half):
    """x * 0.5 * shifted in its three groupings (each Mul's operand order is the matcher's:
    Mul is commutative)."""
    yield op.Mul(op.Mul(x, shifted), half)  # (x * shifted) * 0.5
    yield op.Mul(op.Mul(x, half), shifted)  # (x * 0.5) * shifted
    yield op.Mul(x, op.Mul(shifted, half))  # x * (shifted * 0.5)


def argument_keeps_rank(argument: str, shown: str):
    """A constraint for the sub-pattern computing ``argument`` from x: its own constants may
    be [1]-shaped, harmless unless x is rank 0, where the argument would be rank 1."""
    def constraint(m):
        x_shape = m.graph.static_shape(m.x.name)
        if x_shape is not None and (len(x_shape) >= 1 or
                                    m.graph.static_shape(getattr(m, argument).name) == x_shape):
            return True
        return f"x is not known to be of rank >= 1, nor {shown} of x's rank"
    return constraint

"""``x * 1``, ``x / 1``, ``x - 0`` and ``x + 0`` -> x, where the result is x bit for bit and
has x's shape, as ONNX Runtime's NoopElimination does (onnxscript's optimizer too).

Falcon's rotary embedding multiplies its cos and sin tables by ``attention_scaling``, which is
1.0 unless the RoPE variant rescales: two Mul nodes that change nothing. The constant must be
the identity in every element, and its shape must not broadcast x to a larger one (each of
its dims 1 or x's own size there, no more dims than x). For floats the sign of zero matters:
``-0.0 + 0.0`` is ``+0.0``, so only ``x + (-0.0)`` and ``x - (+0.0)`` are x itself (ONNX
Runtime removes ``x + 0.0`` too); integer zeros always are. A node whose output is a graph
output becomes an Identity that keeps the name.
"""
import math

import numpy as np
import onnx
from onnx import numpy_helper

from graphopt.dsl import Rule, one_of, op, var
from graphopt.ir import STANDARD_DOMAIN

a, b = var("a"), var("b")
MAX_ELEMENTS = 64  # an identity constant is a scalar or a short row of them


def _small_constant(graph, name: str) -> np.ndarray | None:
    """The value of a constant of at most MAX_ELEMENTS elements, its size read before any
    conversion (most operands of an Add or Mul are activations or weights; this runs at
    every one of them, each round)."""
    init = graph.initializer(name)
    if init is None:
        producer = graph.producer_of(name)
        if producer is None or graph.op_key(producer) != (STANDARD_DOMAIN, "Constant"):
            return None
    elif math.prod(init.dims) > MAX_ELEMENTS or graph.is_graph_input(name):
        return None  # (an initializer that is also an input can be fed another value)
    elif init.data_location != onnx.TensorProto.EXTERNAL:
        return numpy_helper.to_array(init)
    return graph.constant_value(name, MAX_ELEMENTS)


def _is_identity(op_type: str, value: np.ndarray) -> bool:
    if value.size == 0:
        return False
    first = value.flat[0]
    if value.size > 1 and not np.all(value == first):
        return False
    if op_type in ("Mul", "Div"):
        return bool(first == 1)
    if first != 0:
        return False
    if value.dtype.kind != "f":
        return True
    # every float zero must have the sign that leaves -0.0 as it is (-0.0 == 0.0 above)
    return bool(np.all(np.signbit(value) == (op_type == "Add")))


def _keeps_shape(value: np.ndarray, shape) -> bool:
    """The constant broadcasts to x's shape without enlarging it: each of its dims is 1 or
    x's own (known) size there, and it has no more dims than x."""
    if value.ndim == 0:
        return True
    if shape is None or value.ndim > len(shape):
        return False
    return all(d == 1 or d == size for d, size in zip(value.shape, shape[-value.ndim:],
                                                      strict=True))


def remove(m):
    op_type = m.node.op_type
    # x * 1 and 1 * x, x + 0 and 0 + x; only x / 1 and x - 0 (the constant second)
    orders = ((m.a, m.b), (m.b, m.a)) if op_type in ("Mul", "Add") else ((m.a, m.b),)
    for kept, constant in orders:
        value = _small_constant(m.graph, constant.name)
        if value is not None and _is_identity(op_type, value) \
                and _keeps_shape(value, kept.shape):
            return kept
    return "no operand is the op's identity element keeping the other's shape"


RULE = Rule(
    name="remove_noop_arithmetic",
    description="x * 1, x / 1, x - 0, x + 0 (sign of zero respected) -> x",
    level=1,
    tags=("cleanup",),
    match=one_of(op.Mul(a, b, _name="node"), op.Div(a, b, _name="node"),
                 op.Add(a, b, _name="node"), op.Sub(a, b, _name="node")),
    rewrite=remove,
)

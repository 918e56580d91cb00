"""Gelu(x + bias), bias a vector along x's last axis (a linear layer's bias before its
exact GELU) -> one com.microsoft BiasGelu (ONNX Runtime's BiasGeluFusion): the sum is no
longer written out and read back, and no longer kept for the backward pass.

The Gelu is com.microsoft's (what gelu_fusion makes of an exported erf) or ONNX's (opset
20, ``approximate="none"``); the sum must be read only by it, its operands in either
order. Training applies the rule before differentiation (BiasGelu -> BiasGeluGrad_dX, the
bias gradient a ReduceSum), like gelu_fusion."""
from __future__ import annotations

from graphopt.dsl import (
    BEFORE_DIFFERENTIATION,
    Rule,
    attr,
    is_float,
    one_of,
    op,
    single_consumer,
    var,
)
from graphopt.vocabulary import MS_DOMAIN

a, b = var("a"), var("b")


def _x_and_bias(m):
    """(x, bias) among the sum's operands, bias the vector along x's last axis, or the
    reason there is none. (The matcher keeps the first operand order of an Add that fits
    the pattern, and both do: the order is decided here.)"""
    shapes = [m.graph.static_shape(v.name) for v in (m.a, m.b)]
    if None in shapes:
        return "shape of an operand of the sum is unknown"
    for x, bias, x_shape, bias_shape in ((m.a, m.b, *shapes), (m.b, m.a, *shapes[::-1])):
        if (len(bias_shape) == 1 and x_shape and bias_shape[0] is not None
                and bias_shape[0] == x_shape[-1]):
            return x, bias
    return f"no operand of the sum is a vector along the other's last axis ({shapes})"


def _bias_along_last_axis(m):
    found = _x_and_bias(m)
    return found if isinstance(found, str) else True


def _exact(m):
    value = getattr(m, "approximate", "none")  # com.microsoft's Gelu has no such attribute
    value = value.decode() if isinstance(value, bytes) else value
    return value == "none" or f"Gelu has approximate={value!r}, not 'none'"


def to_bias_gelu(m):
    return op.ms.BiasGelu(*_x_and_bias(m))


RULE = Rule(
    name="bias_gelu_fusion",
    description="Gelu(Add(x, bias)), bias a vector along x's last axis -> com.microsoft "
                "BiasGelu",
    level=2,
    tags=("fusion", MS_DOMAIN, BEFORE_DIFFERENTIATION),
    match=one_of(op.ms.Gelu(op.Add(a, b, _name="sum")),
                 op.Gelu(op.Add(a, b, _name="sum"), approximate=attr("approximate", "none"))),
    where=[is_float("a", "b", reason="BiasGelu needs float inputs"), _bias_along_last_axis,
           single_consumer("sum"), _exact],
    rewrite=to_bias_gelu,
)

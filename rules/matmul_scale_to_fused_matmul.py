"""MatMul/FusedMatMul scaled by a scalar constant (Mul or Div, before or after) ->
FusedMatMul with that factor folded into alpha (attention's 1/sqrt(d) lands here)."""
from graphopt.dsl import Rule, is_float, one_of, op, scalar_const, single_consumer, var
from graphopt.vocabulary import MS_DOMAIN

from ._fused_matmul import fused_attrs

a, b = var("a"), var("b")
scale = scalar_const("scale", lambda v: v.ndim <= 1 and v.dtype.kind == "f",
                     "scale is not a float scalar (rank <= 1)")


def _bases(x, y):
    return (op.MatMul(x, y, _name="base"), op.ms.FusedMatMul(x, y, _name="base"))


def _scaled(x):
    return (op.Mul(x, scale, _name="scaler"), op.Div(x, scale, _name="scaler"))


def _alternatives():
    for base in _bases(a, b):  # scale applied to the product
        yield op.Mul(base, scale, _name="scaler")
        yield op.Div(base, scale, _name="scaler")
    for scaled in _scaled(a):  # scale applied to an input
        yield from _bases(scaled, b)
    for scaled in _scaled(b):
        yield from _bases(a, scaled)


def _product_scaled(m) -> bool:
    return m.base.output(0).name in [t.name for t in m.scaler.inputs]


def _factor(m) -> float:
    value = float(m.scale)
    return 1.0 / value if m.scaler.op_type == "Div" else value


def _divisor_nonzero(m):
    return m.scaler.op_type != "Div" or float(m.scale) != 0.0 or "division by zero"


def _fusion_removes_a_node(m):
    # The scaled product, or the scaled input, must feed only this pattern: otherwise the
    # node stays for its other readers and the fusion saves nothing (or computes twice).
    return single_consumer("base" if _product_scaled(m) else "scaler")(m)


def _scale_keeps_shape(m):
    # A [1]-shaped scale broadcast against a rank-0 tensor makes it rank 1: folding it into
    # alpha would change the shape the MatMul (or its consumers) sees.
    value = m.scale.value
    if value is None or value.ndim == 0:
        return True
    scaled = [t.name for t in m.scaler.inputs if t.name != m.scale.name]
    shape = m.graph.static_shape(scaled[0]) if scaled else None
    if shape is None:
        return "rank of the scaled tensor is unknown and the scale has rank 1"
    return len(shape) >= 1 or "a rank-1 scale would broadcast a rank-0 tensor to rank 1"


def fold_scale(m):
    attrs = fused_attrs(m.base)
    attrs["alpha"] = attrs["alpha"] * _factor(m)
    return op.ms.FusedMatMul(m.a, m.b, **attrs)


RULE = Rule(
    name="matmul_scale_to_fused_matmul",
    description="MatMul scaled by a scalar constant (Mul/Div, input or output) -> "
                "FusedMatMul(alpha)",
    level=2,
    tags=("fusion", MS_DOMAIN),
    match=one_of(*_alternatives()),
    where=[is_float("a", "b", reason="FusedMatMul needs float inputs"), _divisor_nonzero,
           _fusion_removes_a_node, _scale_keeps_shape],
    rewrite=fold_scale,
)

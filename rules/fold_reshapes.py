"""``Reshape(Reshape(x, s1), s2)`` -> ``Reshape(x, s2)`` when s2 is a constant without entries
that copy a dimension (a 0 under ``allowzero=0``) and nothing else reads the inner Reshape, as
onnxscript's ``reshape_reshape`` rule does.

A Reshape keeps the elements in their order and changes only the shape, so a second one
decides the result alone; only a 0 that copies the inner result's dims ties it to the first.
GPT-2's attention merges its heads with ``view(b, s, 64)`` (``Reshape(.., [0, 0, -1])``) and
its output projection flattens that again (``Reshape(.., [-1, 64])``): one Reshape does both.
"""
import numpy as np

from graphopt.dsl import Rule, check, const, op, single_consumer, var
from graphopt.vocabulary import attribute_default

x, inner_shape = var("x"), var("s1")  # (s1 may be computed: it is dropped)


def _no_copies(m) -> bool:
    value = m.s2.value
    allowzero = m.outer.attr("allowzero", attribute_default("Reshape", "allowzero"))
    return value is not None and value.ndim == 1 and (allowzero or not np.any(value == 0))


RULE = Rule(
    name="fold_reshapes",
    description="Reshape(Reshape(x, s1), s2) -> Reshape(x, s2) (s2 constant, copying no dim)",
    level=1,
    tags=("cleanup",),
    match=op.Reshape(op.Reshape(x, inner_shape, _name="inner"), const("s2"), _name="outer"),
    where=[check(_no_copies, "the outer target is computed, or a 0 in it copies a dim of the "
                             "inner Reshape's result"),
           single_consumer("inner", "the inner Reshape has other readers: it stays anyway")],
    # (allowzero as the outer node has it: left out, as before opset 14, stays left out)
    rewrite=lambda m: op.Reshape(m.x, m.s2, allowzero=m.outer.attr("allowzero")),
)

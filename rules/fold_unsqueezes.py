"""``Unsqueeze(Unsqueeze(x, a), b)`` -> ``Unsqueeze(x, c)``: the axes of both, as positions of
the final result, when nothing else reads the inner Unsqueeze (onnxscript's
``unsqueeze_unsqueeze``).

TorchScript writes ``t[None, None, :, None]`` and ``t[:, None, None, None]`` (the causal
masks of Falcon and GPT-2) as chains of one-axis Unsqueezes. The outer axes b are positions of
the result; the result's other positions, in order, are the inner result's, so the inner axes
a land at those positions. The rank of x must be known (negative axes count from the end).
"""
import numpy as np

from graphopt.dsl import Rule, constant, op, single_consumer, var

x = var("x")


def _axes(m, node) -> list[int] | None:
    """A node's axes: its second input (opset 13+) or its attribute."""
    given = node.input(1)
    if given is not None:
        value = given.value
        return None if value is None or value.dtype.kind not in "iu" else \
            [int(v) for v in value.reshape(-1)]
    axes = node.attr("axes")
    return None if axes is None else list(axes)


def merge(m):
    inner, outer = _axes(m, m.inner), _axes(m, m.outer)
    if inner is None or outer is None:
        return "an Unsqueeze's axes are computed"
    shape = m.x.shape
    if shape is None:
        return "the rank of x is unknown"
    rank = len(shape) + len(inner) + len(outer)
    middle = rank - len(outer)
    outer_set = {a % rank for a in outer}
    kept = [p for p in range(rank) if p not in outer_set]  # the inner result's positions
    axes = sorted(outer_set | {kept[a % middle] for a in inner})
    if len(axes) != len(inner) + len(outer) or not all(-rank <= a < rank for a in outer) \
            or not all(-middle <= a < middle for a in inner):
        return "repeated or out-of-range axes (the node fails at run time: left so)"
    if m.opset >= 13:
        return op.Unsqueeze(m.x, constant(np.array(axes, np.int64), "unsqueeze_axes"))
    return op.Unsqueeze(m.x, axes=axes)


RULE = Rule(
    name="fold_unsqueezes",
    description="Unsqueeze(Unsqueeze(x, a), b) -> one Unsqueeze with both axes",
    level=1,
    tags=("cleanup",),
    match=op.Unsqueeze(op.Unsqueeze(x, _name="inner"), _name="outer"),
    where=[single_consumer("inner", "the inner Unsqueeze has other readers: it stays anyway")],
    rewrite=merge,
)

"""Shape(Transpose(x, perm)) -> Gather(Shape(x), perm): the dimensions of a transposed tensor
are the input's, reordered, so a Transpose read only by a Shape (MPT's attention reads
q.shape after moving the heads axis) need not move any data. fold_shapes then folds the
static dimensions."""
import numpy as np

from graphopt.dsl import Rule, constant, op, single_consumer, var

x = var("x")


def reorder(m):
    perm = m.transpose.attr("perm")
    if perm is None:
        return "the Transpose has no perm (its rank is unknown here)"
    perm = list(perm)
    # Shape's start (default 0) and end (default: the rank) clamp as a Python slice does
    picked = perm[m.shape.attr("start"):m.shape.attr("end")]
    return op.Gather(op.Shape(m.x), constant(np.array(picked, np.int64), "transposed_dims"))


RULE = Rule(
    name="shape_of_transpose",
    description="Shape(Transpose(x, perm)) -> Gather(Shape(x), perm) (the Transpose goes)",
    level=1,
    tags=("canonicalize",),
    match=op.Shape(op.Transpose(x, _name="transpose"), _name="shape"),
    where=[single_consumer("transpose", "the Transpose has other readers: it stays anyway")],
    rewrite=reorder,
)

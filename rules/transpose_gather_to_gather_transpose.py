"""Gather(Transpose(x, perm), one-element index vector, axis) -> Transpose(Gather(x, index,
axis=perm[axis]), perm): the Gather moves onto x itself, where it can join a Split fusion."""
from graphopt.dsl import Rule, const, op, var
from graphopt.vocabulary import attribute_default

x = var("x")


def _index_vector(value) -> bool:
    return value.ndim == 1


def swap(m):
    perm = list(m.transpose.attr("perm") or [])
    if not perm:
        return "Transpose has no perm"
    axis = m.gather.attr("axis", attribute_default("Gather", "axis"))
    axis += len(perm) if axis < 0 else 0
    if not 0 <= axis < len(perm):
        return f"Gather axis {axis} out of range"
    return op.Transpose(op.Gather(m.x, m.indices, axis=perm[axis]), perm=perm)


RULE = Rule(
    name="transpose_gather_to_gather_transpose",
    description="Gather of a Transpose (rank-1 constant index) -> Transpose of a Gather",
    level=1,
    tags=("canonicalize", "mqa"),
    match=op.Gather(op.Transpose(x, _name="transpose"),
                    const("indices", _index_vector, "indices are not a constant vector"),
                    _name="gather"),
    rewrite=swap,
)

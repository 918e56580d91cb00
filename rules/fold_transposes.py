"""Transpose(Transpose(x, p), q) -> Transpose(x, p[q]), or x itself when that is the identity."""
from graphopt.dsl import Rule, op, var

x = var("x")


def compose(m):
    inner, outer = m.inner.attr("perm"), m.outer.attr("perm")
    if inner is None or outer is None:
        return "a Transpose has no perm"
    perm = [list(inner)[i] for i in outer]
    if perm == sorted(perm):
        return m.x
    return op.Transpose(m.x, perm=perm)


RULE = Rule(
    name="fold_transposes",
    description="Two Transposes in a row -> one (or none when they cancel)",
    level=1,
    tags=("canonicalize",),
    match=op.Transpose(op.Transpose(x, _name="inner"), _name="outer"),
    rewrite=compose,
)

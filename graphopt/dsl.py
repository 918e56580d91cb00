"""The declarative rule language: patterns, constraints, results and rule metadata.

A pattern and a result are written with the same ``op`` builder::

    a, b = var("a"), var("b")
    Rule(name="matmul_transpose_b", match=op.MatMul(a, op.Transpose(b, perm=[1, 0])),
         rewrite=lambda m: op.ms.FusedMatMul(m.a, m.b, transB=1), ...)

In a pattern, keyword arguments constrain attributes (a value, a predicate, or
``attr("name")`` to bind the value); in a result they set attributes. ``_name="t"`` binds
the matched node; ``_outputs=n`` makes a multi-output result. Commutative operands
(Add, Mul, ...) are tried in both orders by the matcher. ``fan_out`` matches one tensor and
all its consumers of given op types, the shape the Split fusion needs.

This module is what rules import: the pattern language (graphopt.patterns), the ``where``
constraints (graphopt.constraints) and the rule metadata (Rule, Pass) defined here.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from .constraints import (
    check,
    inner_nodes_read_only_by_match,
    is_float,
    produced_by,
    single_consumer,
)
from .patterns import (
    COMMUTATIVE_OPS,
    AttrBinding,
    Const,
    Expr,
    FanOut,
    NewConstant,
    OneOf,
    OpExpr,
    OpOutput,
    Var,
    attr,
    const,
    constant,
    fan_out,
    one_of,
    op,
    scalar_const,
    var,
)

__all__ = ["ALL_PROVIDERS", "BEFORE_DIFFERENTIATION", "COMMUTATIVE_OPS", "AttrBinding", "Const",
           "Expr", "FanOut", "NewConstant", "OneOf", "OpExpr", "OpOutput", "Pass", "Rule", "Var",
           "attr", "check", "const", "constant", "fan_out", "inner_nodes_read_only_by_match",
           "is_float", "one_of", "op", "produced_by", "scalar_const", "single_consumer", "var"]

ALL_PROVIDERS = frozenset({"cpu", "cuda", "rocm"})
# A Rule tag: the rule's result has a gradient in graphopt.training, so training applies it
# to the forward graph before differentiating it, whatever its level (within the one asked).
BEFORE_DIFFERENTIATION = "before_differentiation"


@dataclass(eq=False)
class Rule:
    """A pattern rewrite rule: data the engine compiles and drives."""

    name: str
    description: str
    match: Expr | FanOut | OneOf
    rewrite: Callable
    level: int = 1
    where: list = field(default_factory=list)
    tags: tuple[str, ...] = ()
    providers: frozenset[str] = ALL_PROVIDERS
    min_opset: dict[str, int] = field(default_factory=dict)

    kind = "rule"


@dataclass(eq=False)
class Pass:
    """A graph-wide transformation that is not pattern-shaped (same metadata as a Rule).

    ``run(graph, report)`` edits the graph through its journaled primitives and returns the
    number of changes it made (0 when the graph already is as the pass wants it)."""

    name: str
    description: str
    run: Callable
    level: int = 1
    tags: tuple[str, ...] = ()
    providers: frozenset[str] = ALL_PROVIDERS
    min_opset: dict[str, int] = field(default_factory=dict)

    kind = "pass"

"""The pattern language: what a rule's pattern and its result are made of.

``op.X(...)`` builds an op expression (``op.ms.X`` a com.microsoft one), ``var``/``const``/
``scalar_const``/``attr`` the leaves a pattern binds, ``constant`` a new initializer in a
result, ``fan_out`` a tensor with all its consumers of some op types, ``one_of`` alternative
patterns. Plain data: the matcher (graphopt.matching) compiles it, the rewrite builds from it.
Rules reach it through graphopt.dsl.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from .ir import MS_DOMAIN, STANDARD_DOMAIN

COMMUTATIVE_OPS = frozenset({"Add", "Mul", "Max", "Min", "Sum", "Mean", "Equal", "And", "Or",
                             "Xor"})


class Expr:
    """A node of a pattern or of a result expression."""


@dataclass(eq=False)
class Var(Expr):
    """Any tensor; the same name used twice must bind the same tensor."""

    name: str


@dataclass(eq=False)
class Const(Expr):
    """A tensor whose value is known (initializer or Constant node), optionally checked."""

    name: str
    predicate: Callable[[np.ndarray], bool] | None = None
    reason: str = "constant value rejected"
    scalar: bool = False


@dataclass(eq=False)
class AttrBinding:
    """In a pattern's attribute position: bind the attribute's value (or default) to a name."""

    name: str
    default: Any = None


@dataclass(eq=False)
class NewConstant(Expr):
    """In a result: a new initializer holding ``value``, named after ``hint``."""

    value: np.ndarray
    hint: str = "const"


@dataclass(eq=False, slots=True)  # rewrites build one per match: slots make that cheaper
class OpExpr(Expr):
    op_type: str
    domain: str
    inputs: tuple
    attrs: dict
    bind: str | None = None
    n_outputs: int = 1
    commutative: bool = False


@dataclass(eq=False)
class OpOutput(Expr):
    op: OpExpr
    index: int


class _OpBuilder:
    def __init__(self, domain: str = STANDARD_DOMAIN):
        self._domain = domain

    def __getattr__(self, op_type: str):
        if op_type.startswith("_"):
            raise AttributeError(op_type)
        builder = self._builder(op_type)
        setattr(self, op_type, builder)  # later lookups skip __getattr__
        return builder

    def _builder(self, op_type: str):
        domain = self._domain
        commutative = op_type in COMMUTATIVE_OPS and domain == ""

        def build(*inputs, _name: str | None = None, _outputs: int = 1, **attrs):
            expr = OpExpr(op_type, domain, inputs, attrs, _name, _outputs, commutative)
            if _outputs == 1:
                return expr
            return tuple(OpOutput(expr, i) for i in range(_outputs))
        return build

    def domain(self, name: str) -> _OpBuilder:
        return _OpBuilder(name)


class _Ops(_OpBuilder):
    """``op.X`` builds a standard-domain op; ``op.ms.X`` a com.microsoft one."""

    def __init__(self):
        super().__init__(STANDARD_DOMAIN)
        self.ms = _OpBuilder(MS_DOMAIN)


op = _Ops()


def var(name: str) -> Var:
    return Var(name)


def const(name: str, predicate=None, reason: str = "constant value rejected") -> Const:
    return Const(name, predicate, reason)


def scalar_const(name: str, predicate=None, reason: str = "not the expected scalar") -> Const:
    return Const(name, predicate, reason, scalar=True)


def attr(name: str, default: Any = None) -> AttrBinding:
    return AttrBinding(name, default)


def constant(value, hint: str = "const") -> NewConstant:
    return NewConstant(np.asarray(value), hint)


@dataclass(eq=False)
class FanOut:
    """Tensor ``source`` and all of its consumers whose op type is one of ``consumer_types``
    reading it at ``input_index``; other consumers may exist and keep reading it."""

    source: Var
    consumer_types: tuple[str, ...]
    input_index: int = 0
    min_consumers: int = 2
    bind: str = "consumers"


def fan_out(source: Var, consumers: Iterable[str], input_index: int = 0,
            min_consumers: int = 2, bind: str = "consumers") -> FanOut:
    return FanOut(source, tuple(consumers), input_index, min_consumers, bind)


@dataclass(eq=False)
class OneOf:
    """Alternative patterns for one rule, tried in order; the first that matches wins."""

    alternatives: tuple


def one_of(*alternatives) -> OneOf:
    return OneOf(tuple(alternatives))

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
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .ir import MS_DOMAIN, STANDARD_DOMAIN
from .vocabulary import FLOAT_TYPES

ALL_PROVIDERS = frozenset({"cpu", "cuda", "rocm"})
# A Rule tag: the rule's result has a gradient in graphopt.training, so training applies it
# to the forward graph before differentiating it, whatever its level (within the one asked).
BEFORE_DIFFERENTIATION = "before_differentiation"
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


def check(predicate: Callable, reason: str) -> Callable:
    """A ``where`` constraint: ``predicate(m)`` must hold, else ``reason`` explains why not."""

    def constraint(m):
        return True if predicate(m) else reason
    constraint.reason = reason
    return constraint


def single_consumer(node: str, reason: str | None = None) -> Callable:
    """The bound node's output feeds only the pattern (so fusing it removes it)."""

    def constraint(m):
        view = getattr(m, node)
        out = view.proto.output[0]
        if m.graph.consumer_count(out) == 1 and not m.graph.is_output(out):
            return True
        return reason or f"output of {view.op_type} '{view.name}' has other consumers"
    return constraint


def inner_nodes_read_only_by_match() -> Callable:
    """Every matched node but the match's roots is read only by matched nodes and is no graph
    output: the rewrite's dead-node removal then takes them all with the match, instead of
    their part being computed twice."""

    def constraint(m):
        matched = set(m.nodes)
        found = _read_outside(m.graph, matched.difference(m.roots), matched)
        if found is None:
            return True
        node_id, out = found
        return (f"output {out!r} of a {m.graph.node(node_id).op_type} in the pattern "
                "has other consumers")
    return constraint


def _read_outside(graph, node_ids, inside: set):
    """(node, output) of the first of ``node_ids`` with an output that is a graph output or
    is read by a node not in ``inside``; None when every output stays inside."""
    for node_id in node_ids:
        for out in graph.node(node_id).output:
            if graph.is_output(out) or not inside.issuperset(graph.consumers_of(out)):
                return node_id, out
    return None


def _bound_tensor(m, name: str) -> str:
    """matching.views.bound_tensor, imported on first use (graphopt.matching imports this
    module); the global is then rebound to it."""
    global _bound_tensor
    from .matching.views import bound_tensor

    _bound_tensor = bound_tensor
    return bound_tensor(m, name)


def produced_by(tensor: str, pattern: Expr | OneOf, shared: Iterable[str] = (),
                what: str = "the sub-pattern") -> Callable:
    """A ``where`` constraint: the tensor bound to ``tensor`` is computed by ``pattern`` (an op
    pattern or ``one_of``, matched at the tensor's producer as rules are), whose variables
    named in ``shared`` bind the match's own tensors of those names, and whose nodes are read
    by each other and the match's nodes only (the rewrite's dead-node removal then takes
    them with the match).

    For an expression under an op the rule anchors on: in the rule's own pattern each
    commutative op above it doubles the matcher code generated for it (the tanh GELU's
    argument, under six of them, made 44,000 lines); checked here, it is generated once."""
    shared = tuple(shared)
    compiled: list = []

    def constraint(m):
        if not compiled:
            from .matching import compiled_pattern  # graphopt.matching imports this module

            compiled.append(compiled_pattern(pattern))
        graph = m.graph
        name = _bound_tensor(m, tensor)
        reason = f"'{tensor}' is not {what}"
        producer = graph.producer_of(name)
        bind = None if producer is None else compiled[0].fast_by_key.get(graph.op_key(producer))
        found = None if bind is None else bind(graph)(producer)
        if found is None:  # why not, as --explain says it for a rule's own pattern
            miss = None if producer is None else compiled[0].match(graph, producer)
            return f"{reason}: {miss}" if miss is not None else reason
        for var_name in shared:
            if _bound_tensor(found, var_name) != _bound_tensor(m, var_name):
                return f"{reason} of the same '{var_name}'"
        outside = _read_outside(graph, found.nodes, set(found.nodes).union(m.nodes))
        if outside is not None:
            return f"{reason} read only by the pattern ('{outside[1]}' has other consumers)"
        return True
    constraint.reason = f"'{tensor}' is not {what}"
    return constraint


def is_float(*names: str, reason: str | None = None) -> Callable:
    """The element type shared by these tensors (one known suffices) is a float type."""

    def constraint(m):
        elem_type = m.graph.elem_type
        for infer in (False, True):  # cheap lookups for all names before any inference
            for name in names:
                elem = elem_type(_bound_tensor(m, name), infer)
                if elem is not None:
                    return True if elem in FLOAT_TYPES else (
                        reason or f"'{name}' has element type {elem}, not a float type")
        return reason or f"element type of {', '.join(names)} is unknown"
    return constraint


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

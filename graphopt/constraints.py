"""The ``where`` constraints of a rule: checks on a match the pattern alone cannot state,
each returning True or the reason the match is declined (what --explain prints).
Rules reach them through graphopt.dsl.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

from .matching import bound_tensor, compiled_pattern
from .patterns import Expr, OneOf
from .vocabulary import FLOAT_TYPES


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
        if not compiled:   # compiled at the first match it sees, not when the rule is made
            compiled.append(compiled_pattern(pattern))
        graph = m.graph
        name = bound_tensor(m, tensor)
        reason = f"'{tensor}' is not {what}"
        producer = graph.producer_of(name)
        bind = None if producer is None else compiled[0].fast_by_key.get(graph.op_key(producer))
        found = None if bind is None else bind(graph)(producer)
        if found is None:  # why not, as --explain says it for a rule's own pattern
            miss = None if producer is None else compiled[0].match(graph, producer)
            return f"{reason}: {miss}" if miss is not None else reason
        for var_name in shared:
            if bound_tensor(found, var_name) != bound_tensor(m, var_name):
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
                elem = elem_type(bound_tensor(m, name), infer)
                if elem is not None:
                    return True if elem in FLOAT_TYPES else (
                        reason or f"'{name}' has element type {elem}, not a float type")
        return reason or f"element type of {', '.join(names)} is unknown"
    return constraint

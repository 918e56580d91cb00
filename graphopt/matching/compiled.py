"""A rule's pattern, compiled: where it anchors and the two matchers codegen writes for it
(FAST for the engine's candidates, EXPLAIN for --explain); a fan-out's matcher."""
from __future__ import annotations

from ..ir import Graph
from ..patterns import Expr, FanOut, OneOf, OpExpr
from .codegen import EXPLAIN, FAST, Bindings, generate
from .misses import JoinedMiss, Miss, NodeLabel


class CompiledPattern:
    """What the engine drives: anchor op types and two ways to match at an anchor.

    ``match(graph, anchor)`` returns (bindings, roots) or a Miss saying why not (for
    --explain and fan-out rules). ``fast_by_key[op key](graph)`` binds the matcher the
    engine runs otherwise to a graph: ``fast(node)``, a Match or None, with no Miss built.
    Both come from one description of the pattern (graphopt.matching.codegen)."""

    def __init__(self, pattern: Expr | FanOut | OneOf):
        self.pattern = pattern
        if isinstance(pattern, OneOf):
            alternatives = list(pattern.alternatives)
            for alternative in alternatives:
                if not isinstance(alternative, (OpExpr, FanOut)):
                    raise TypeError("a rule's match must be an op pattern or a fan_out")
            if any(isinstance(p, FanOut) for p in alternatives):
                raise TypeError("one_of takes op patterns only")
        elif isinstance(pattern, FanOut):
            self._init_fan_out(pattern)
            return
        elif isinstance(pattern, OpExpr):
            alternatives = [pattern]
        else:
            raise TypeError("a rule's match must be an op pattern or a fan_out")
        by_key: dict[tuple[str, str], list[OpExpr]] = {}
        for alternative in alternatives:
            by_key.setdefault((alternative.domain, alternative.op_type), []).append(alternative)
        self.anchor_types = list(by_key)
        self.fast_by_key = {key: generate(alts, FAST) for key, alts in by_key.items()}
        # the explaining matchers are made on first use: only --explain and a rule's
        # constraints ask for them, and a pattern with nested commutative ops costs as much
        # again to generate
        self._alternatives_by_key = by_key
        self._explain_by_key: dict = {}
        self.anchors_at_node = True
        self.anchor_of = _node_itself
        self.match = self._explain

    def _explain(self, graph: Graph, node_id: int):
        key = graph.op_key(node_id)
        explain = self._explain_by_key.get(key)
        if explain is None and key in self._alternatives_by_key:
            explain = self._explain_by_key[key] = generate(self._alternatives_by_key[key],
                                                           EXPLAIN)
        if explain is not None:
            return explain(graph)(node_id)
        if isinstance(self.pattern, OneOf):
            return JoinedMiss([])  # no alternative anchors at this op type
        return Miss("{} is not {}", NodeLabel(graph.nodes[node_id]), self.pattern.op_type)

    def _init_fan_out(self, pattern: FanOut) -> None:
        self.anchor_types = [("", t) for t in pattern.consumer_types]
        self.match = _fan_out_matcher(pattern)
        self.fast_by_key = {}
        self.anchors_at_node = False  # at the tensor the consumers read
        index = pattern.input_index

        def anchor_of(graph: Graph, node_id: int):
            inputs = graph.inputs_of(node_id)
            return inputs[index] if len(inputs) > index else None
        self.anchor_of = anchor_of


_compiled: dict[int, tuple[object, CompiledPattern]] = {}
_MAX_KEPT = 1024  # patterns made on the fly (tests, plugins' factories) past this: forgotten


def compiled_pattern(pattern: Expr | FanOut | OneOf) -> CompiledPattern:
    """``CompiledPattern(pattern)``, made once per pattern object in a process: rules are
    module-level objects, and every optimize (a training run makes two) would otherwise
    generate and compile their matchers again. What it makes binds no graph."""
    key = id(pattern)
    entry = _compiled.get(key)
    if entry is None or entry[0] is not pattern:  # the pattern it was made for is kept alive
        if len(_compiled) >= _MAX_KEPT:
            _compiled.clear()
        entry = _compiled[key] = (pattern, CompiledPattern(pattern))
    return entry[1]


def _node_itself(graph: Graph, node_id: int) -> int:
    return node_id


def _fan_out_matcher(pattern: FanOut):
    types = set(pattern.consumer_types)
    index, source = pattern.input_index, pattern.source.name

    def match(graph: Graph, tensor: str):
        op_key, inputs_of = graph.op_key, graph.inputs_of
        users = [u for u in graph.consumers_of(tensor)
                 if op_key(u)[1] in types and not op_key(u)[0]
                 and len(inputs_of(u)) > index and inputs_of(u)[index] == tensor]
        if len(users) < pattern.min_consumers:
            return Miss("'{}' has {} {} consumer(s), needs at least {}", tensor,
                        len(users), "/".join(pattern.consumer_types), pattern.min_consumers)
        users.sort(key=graph.order_of)
        b = Bindings({source: tensor, pattern.bind: users},
                     {source: "tensor", pattern.bind: "nodes"}, list(users))
        return b, users
    return match

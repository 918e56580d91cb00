"""A rule's pattern, compiled: where it anchors and the two matchers codegen writes for it
(FAST for the engine's candidates, EXPLAIN for --explain); a fan-out's matcher."""
from __future__ import annotations

from ..dsl import Expr, FanOut, OneOf, OpExpr
from ..ir import Graph
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
        self._explain_by_key = {key: generate(alts, EXPLAIN) for key, alts in by_key.items()}
        self.anchors_at_node = True
        self.anchor_of = _node_itself
        self.match = self._explain

    def _explain(self, graph: Graph, node_id: int):
        explain = self._explain_by_key.get(graph.op_key(node_id))
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

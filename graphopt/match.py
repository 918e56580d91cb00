"""Compiles DSL patterns into matcher closures and gives rules a view of what matched."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx

from .dsl import AttrBinding, Const, Expr, FanOut, OneOf, OpExpr, OpOutput, Var
from .ir import Graph, get_attr, normalize_domain


class Miss:
    """Why a pattern did not match; the text is only built when someone asks."""

    __slots__ = ("fmt", "args")

    def __init__(self, fmt: str, *args):
        self.fmt, self.args = fmt, args

    def __str__(self) -> str:
        return self.fmt.format(*self.args)


class _NodeLabel:
    """A node's name for a Miss, formatted only if the Miss is ever shown."""

    __slots__ = ("node",)

    def __init__(self, node: onnx.NodeProto):
        self.node = node

    def __str__(self) -> str:
        node = self.node
        return f"{node.op_type} '{node.name}'" if node.name else f"{node.op_type} (unnamed)"


def _node_label(graph: Graph, node_id: int) -> _NodeLabel:
    return _NodeLabel(graph.nodes[node_id])


def _same_attr(actual, expected) -> bool:
    if isinstance(actual, bytes):
        actual = actual.decode()
    if isinstance(expected, (list, tuple)):
        return actual is not None and list(actual) == list(expected)
    return actual == expected


class Bindings(dict):
    """name -> tensor name / node id / attribute value, plus the matched nodes in order."""

    __slots__ = ("nodes", "kinds")

    def __init__(self):
        super().__init__()
        self.nodes: list[int] = []
        self.kinds: dict[str, str] = {}

    def copy(self) -> Bindings:
        other = Bindings()
        other.update(self)
        other.nodes = list(self.nodes)
        other.kinds = dict(self.kinds)
        return other


Matcher = Callable[[Graph, int, Bindings], "Miss | None"]


def compile_op(pattern: OpExpr) -> Matcher:
    """A closure matching ``pattern`` rooted at a node id; fills bindings, returns a Miss."""
    op_type, domain = pattern.op_type, pattern.domain
    attr_checks = list(pattern.attrs.items())
    inputs = [_compile_input(p) for p in pattern.inputs]
    arity = len(inputs)
    orders = [(0, 1), (1, 0)] if pattern.commutative and arity == 2 else [tuple(range(arity))]

    def match(graph: Graph, node_id: int, b: Bindings):
        node = graph.nodes[node_id]
        if node.op_type != op_type or normalize_domain(node.domain) != domain:
            return Miss("{} is not {}", _node_label(graph, node_id), op_type)
        if len(node.input) < arity:
            return Miss("{} has {} inputs, pattern needs {}", _node_label(graph, node_id),
                        len(node.input), arity)
        for name, expected in attr_checks:
            actual = get_attr(node, name)
            if isinstance(expected, AttrBinding):
                b[expected.name] = expected.default if actual is None else actual
                b.kinds[expected.name] = "attr"
            elif callable(expected):
                if not expected(actual):
                    return Miss("{} attribute {}={} rejected", _node_label(graph, node_id),
                                name, actual)
            elif not _same_attr(actual, expected):
                return Miss("{} attribute {}={}, pattern needs {}",
                            _node_label(graph, node_id), name, actual, expected)
        if pattern.bind:
            b[pattern.bind] = node_id
            b.kinds[pattern.bind] = "node"
        b.nodes.append(node_id)
        miss = None
        for order in orders:
            trial = b.copy() if len(orders) > 1 else b
            for position, input_index in enumerate(order):
                miss = inputs[position](graph, node.input[input_index], trial)
                if miss is not None:
                    break
            if miss is None:
                if trial is not b:
                    b.clear()
                    b.update(trial)
                    b.nodes[:] = trial.nodes
                    b.kinds.update(trial.kinds)
                return None
        return miss
    return match


def _compile_input(pattern) -> Callable[[Graph, str, Bindings], Miss | None]:
    if isinstance(pattern, Var):
        name = pattern.name

        def match_var(graph, tensor, b):
            if not tensor:
                return Miss("optional input '{}' is absent", name)
            bound = b.get(name)
            if bound is not None and bound != tensor:
                return Miss("'{}' must be the same tensor in both places ({} vs {})",
                            name, bound, tensor)
            b[name] = tensor
            b.kinds[name] = "tensor"
            return None
        return match_var
    if isinstance(pattern, Const):
        return _compile_const(pattern)
    if isinstance(pattern, (OpExpr, OpOutput)):
        op_pattern = pattern.op if isinstance(pattern, OpOutput) else pattern
        output_index = pattern.index if isinstance(pattern, OpOutput) else 0
        inner = compile_op(op_pattern)

        def match_producer(graph, tensor, b):
            producer = graph.producer.get(tensor)
            if producer is None:
                return Miss("'{}' is not produced by a {} node", tensor, op_pattern.op_type)
            if graph.nodes[producer].output[output_index] != tensor:
                return Miss("'{}' is not output {} of {}", tensor, output_index,
                            _node_label(graph, producer))
            return inner(graph, producer, b)
        return match_producer
    raise TypeError(f"cannot use {pattern!r} as a pattern input")


def _compile_const(pattern: Const):
    name = pattern.name

    def match_const(graph, tensor, b):
        value = graph.constant_value(tensor) if tensor else None
        if value is None:
            return Miss("'{}' ({}) is not a constant", name, tensor or "absent")
        if pattern.scalar and value.size != 1:
            return Miss("'{}' ({}) has {} elements, not one", name, tensor, value.size)
        if pattern.predicate is not None and not pattern.predicate(value):
            return Miss("'{}' ({}): {}", name, tensor, pattern.reason)
        b[name] = tensor
        b.kinds[name] = "tensor"
        return None
    return match_const


class CompiledPattern:
    """What the engine drives: anchor op types and a matcher from an anchor to bindings."""

    def __init__(self, pattern: Expr | FanOut | OneOf):
        self.pattern = pattern
        if isinstance(pattern, OneOf):
            alternatives = [CompiledPattern(p) for p in pattern.alternatives]
            if any(isinstance(p, FanOut) for p in pattern.alternatives):
                raise TypeError("one_of takes op patterns only")
            self.anchor_types = list(dict.fromkeys(
                key for alt in alternatives for key in alt.anchor_types))
            self.match = self._first_of(alternatives)
            self.anchor_of = lambda graph, node_id: node_id
        elif isinstance(pattern, FanOut):
            self.anchor_types = [("", t) for t in pattern.consumer_types]
            self.match = self._fan_out_matcher(pattern)
            self.anchor_of = lambda graph, node_id: (
                graph.nodes[node_id].input[pattern.input_index]
                if len(graph.nodes[node_id].input) > pattern.input_index else None)
        elif isinstance(pattern, OpExpr):
            self.anchor_types = [(pattern.domain, pattern.op_type)]
            self.match = self._op_matcher(pattern)
            self.anchor_of = lambda graph, node_id: node_id
        else:
            raise TypeError("a rule's match must be an op pattern or a fan_out")

    @staticmethod
    def _first_of(alternatives):
        def match(graph, node_id):
            node = graph.nodes[node_id]
            key = (normalize_domain(node.domain), node.op_type)
            misses = []
            for alt in alternatives:
                if key in alt.anchor_types:
                    found = alt.match(graph, node_id)
                    if not isinstance(found, Miss):
                        return found
                    misses.append(found)
            return misses[0] if len(misses) == 1 else Miss(
                "{}", "; ".join(str(m) for m in misses))
        return match

    @staticmethod
    def _op_matcher(pattern: OpExpr):
        inner = compile_op(pattern)

        def match(graph, node_id):
            b = Bindings()
            miss = inner(graph, node_id, b)
            if miss is not None:
                return miss
            return b, [node_id]
        return match

    @staticmethod
    def _fan_out_matcher(pattern: FanOut):
        types = set(pattern.consumer_types)
        index, source = pattern.input_index, pattern.source.name

        def match(graph, tensor):
            users = [u for u in graph.consumers.get(tensor, ())
                     if graph.nodes[u].op_type in types
                     and not normalize_domain(graph.nodes[u].domain)
                     and len(graph.nodes[u].input) > index
                     and graph.nodes[u].input[index] == tensor]
            if len(users) < pattern.min_consumers:
                return Miss("'{}' has {} {} consumer(s), needs at least {}", tensor,
                            len(users), "/".join(pattern.consumer_types), pattern.min_consumers)
            users.sort(key=graph.order.__getitem__)
            b = Bindings()
            b[source] = tensor
            b.kinds[source] = "tensor"
            b[pattern.bind] = users
            b.kinds[pattern.bind] = "nodes"
            b.nodes.extend(users)
            return b, users
        return match


class NodeView:
    """A matched node as rules see it."""

    def __init__(self, graph: Graph, node_id: int):
        self.graph, self.id = graph, node_id
        self.proto = graph.nodes[node_id]

    name = property(lambda self: self.proto.name)
    op_type = property(lambda self: self.proto.op_type)
    inputs = property(lambda self: [TensorView(self.graph, n) for n in self.proto.input])
    outputs = property(lambda self: [TensorView(self.graph, n) for n in self.proto.output])

    def attr(self, name: str, default=None):
        return get_attr(self.proto, name, default)

    def input(self, index: int) -> TensorView | None:
        names = self.proto.input
        return TensorView(self.graph, names[index]) if index < len(names) and names[index] \
            else None

    def __repr__(self) -> str:
        return f"<{self.op_type} {self.name!r}>"


class TensorView:
    """A tensor as rules see it: name, type, static shape, constant value, neighbours."""

    def __init__(self, graph: Graph, name: str):
        self.graph, self.name = graph, name

    elem_type = property(lambda self: self.graph.elem_type(self.name))
    shape = property(lambda self: self.graph.static_shape(self.name))

    @property
    def value(self) -> np.ndarray | None:
        return self.graph.constant_value(self.name)

    @property
    def producer(self) -> NodeView | None:
        node_id = self.graph.producer.get(self.name)
        return None if node_id is None else NodeView(self.graph, node_id)

    @property
    def consumers(self) -> list[NodeView]:
        return [NodeView(self.graph, i) for i in self.graph.consumers_of(self.name)]

    def __float__(self) -> float:
        return float(self._scalar())

    def __int__(self) -> int:
        return int(self._scalar())

    def _scalar(self):
        value = self.value
        if value is None or value.size != 1:
            raise ValueError(f"'{self.name}' is not a scalar constant")
        return value.reshape(()).item()

    def __repr__(self) -> str:
        return f"<tensor {self.name!r}>"


class Match:
    """Attribute access to a pattern's bindings: ``m.a`` (tensor), ``m.t`` (node), ..."""

    def __init__(self, graph: Graph, bindings: Bindings, roots: list[int]):
        self._graph, self._bindings, self.roots = graph, bindings, roots
        self.nodes = bindings.nodes

    def __getattr__(self, name: str):
        try:
            value = self._bindings[name]
        except KeyError:
            raise AttributeError(f"pattern binds no '{name}'") from None
        kind = self._bindings.kinds[name]
        if kind == "tensor":
            return TensorView(self._graph, value)
        if kind == "node":
            return NodeView(self._graph, value)
        if kind == "nodes":
            return [NodeView(self._graph, i) for i in value]
        return value

    def get(self, name: str, default=None):
        return getattr(self, name) if name in self._bindings else default

    @property
    def graph(self) -> Graph:
        return self._graph

    @property
    def opset(self) -> int:
        return self._graph.model.opset("") or 1


def tensor_dtype(elem_type: int) -> np.dtype:
    return onnx.helper.tensor_dtype_to_np_dtype(elem_type)

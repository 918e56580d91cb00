"""Compiles DSL patterns into matcher closures and gives rules a view of what matched."""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx

from .dsl import AttrBinding, Const, Expr, FanOut, OneOf, OpExpr, OpOutput, Var
from .ir import Graph, get_attr


class Miss:
    """Why a pattern did not match; the text is only built when someone asks."""

    __slots__ = ("fmt", "args")

    def __init__(self, fmt: str, *args):
        self.fmt, self.args = fmt, args

    def __str__(self) -> str:
        return self.fmt.format(*self.args)


class _RecheckedMiss(Miss):
    """A Miss found by a cheap pre-check; its reason comes from running the full matcher,
    and only if someone shows it (the engine does so at once, before the graph changes)."""

    __slots__ = ("matcher", "graph", "anchor")

    def __init__(self, matcher, graph: Graph, anchor):
        self.matcher, self.graph, self.anchor = matcher, graph, anchor

    def __str__(self) -> str:
        found = self.matcher(self.graph, self.anchor)
        return str(found) if isinstance(found, Miss) else "no match"


class _JoinedMiss(Miss):
    """The misses of several alternatives, joined only when shown."""

    __slots__ = ("misses",)

    def __init__(self, misses: list[Miss]):
        self.misses = misses

    def __str__(self) -> str:
        return "; ".join(str(m) for m in self.misses)


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
    op_type, bind = pattern.op_type, pattern.bind
    key = (pattern.domain, op_type)
    attr_checks = list(pattern.attrs.items())
    inputs = [_compile_input(p) for p in pattern.inputs]
    arity = len(inputs)
    commutative = pattern.commutative and arity == 2

    def match(graph: Graph, node_id: int, b: Bindings):
        if graph.op_keys[node_id] != key:
            return Miss("{} is not {}", _node_label(graph, node_id), op_type)
        names = graph.node_inputs[node_id]
        if len(names) < arity:
            return Miss("{} has {} inputs, pattern needs {}", _node_label(graph, node_id),
                        len(names), arity)
        if attr_checks:
            miss = _check_attributes(graph, node_id, graph.nodes[node_id], attr_checks, b)
            if miss is not None:
                return miss
        if bind:
            b[bind] = node_id
            b.kinds[bind] = "node"
        b.nodes.append(node_id)
        if commutative:
            return _match_either_order(graph, names, inputs, b)
        for position, match_input in enumerate(inputs):
            miss = match_input(graph, names[position], b)
            if miss is not None:
                return miss
        return None
    return match


def _check_attributes(graph: Graph, node_id: int, node, attr_checks, b: Bindings):
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
    return None


def _match_either_order(graph: Graph, names, inputs, b: Bindings):
    """Both operand orders of a commutative op, each on a copy of the bindings; the first
    that matches is kept. When both miss, the reported Miss is the one from the order that
    got further (more operands and nodes matched): that is the near miss a user would mean."""
    best, best_progress = None, (-1, -1)
    for order in ((0, 1), (1, 0)):
        trial = b.copy()
        miss = None
        for position, input_index in enumerate(order):
            miss = inputs[position](graph, names[input_index], trial)
            if miss is not None:
                break
        if miss is None:
            b.clear()
            b.update(trial)
            b.nodes[:] = trial.nodes
            b.kinds.update(trial.kinds)
            return None
        progress = (position, len(trial.nodes))
        if progress > best_progress:
            best, best_progress = miss, progress
    return best


def compile_precheck(pattern: OpExpr):
    """A cheap necessary condition for ``pattern`` to match at a node, or None if there is
    nothing cheap to test: enough inputs, and each input the pattern wants produced by an op
    comes from a node of that (domain, op_type). It needs no bindings and builds no Miss, so
    the engine can discard most alternatives of a rule with a few dict lookups."""
    arity = len(pattern.inputs)
    required = [(position, (p.op.domain, p.op.op_type) if isinstance(p, OpOutput)
                 else (p.domain, p.op_type))
                for position, p in enumerate(pattern.inputs) if isinstance(p, (OpExpr, OpOutput))]
    if not required and not arity:
        return None
    layouts = [required]
    if pattern.commutative and arity == 2 and required:
        layouts.append([(1 - position, key) for position, key in required])
    if len(layouts) == 1 and len(required) == 1:
        return _single_producer_precheck(arity, *required[0])

    def precheck(graph: Graph, node_id: int) -> bool:
        names = graph.node_inputs[node_id]
        if len(names) < arity:
            return False
        producers, op_keys = graph.producer, graph.op_keys
        for layout in layouts:
            for position, key in layout:
                producer = producers.get(names[position])
                if producer is None or op_keys[producer] != key:
                    break
            else:
                return True
        return False
    return precheck


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
            if graph.node_outputs[producer][output_index] != tensor:
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


def _single_producer_precheck(arity: int, position: int, key: tuple[str, str]):
    """compile_precheck's test when one input must come from one op type (the usual case)."""

    def precheck(graph: Graph, node_id: int) -> bool:
        names = graph.node_inputs[node_id]
        if len(names) < arity:
            return False
        producer = graph.producer.get(names[position])
        return producer is not None and graph.op_keys[producer] == key
    return precheck


class CompiledPattern:
    """What the engine drives: anchor op types and two ways to match at an anchor.

    ``match(graph, anchor)`` returns (bindings, roots) or a Miss saying why not (for
    --explain). ``viable(graph, anchor)`` returns the full matchers worth running there,
    those of the alternatives whose cheap pre-check passes, often none: most candidates
    are rejected with a few dict lookups and no Miss built."""

    def __init__(self, pattern: Expr | FanOut | OneOf):
        self.pattern = pattern
        self.precheck = None  # an op pattern's compile_precheck, used by an enclosing one_of
        if isinstance(pattern, OneOf):
            alternatives = [CompiledPattern(p) for p in pattern.alternatives]
            if any(isinstance(p, FanOut) for p in pattern.alternatives):
                raise TypeError("one_of takes op patterns only")
            self.anchor_types = list(dict.fromkeys(
                key for alt in alternatives for key in alt.anchor_types))
            self.match, self.viable = self._first_of(alternatives)
            self.full_match = self.match
            self.anchors_at_node = True
            self.anchor_of = lambda graph, node_id: node_id
        elif isinstance(pattern, FanOut):
            self.anchor_types = [("", t) for t in pattern.consumer_types]
            self.match = self.full_match = self._fan_out_matcher(pattern)
            always = (self.match,)
            self.viable = lambda graph, tensor: always
            self.anchors_at_node = False  # at the tensor the consumers read
            self.anchor_of = lambda graph, node_id: (
                graph.node_inputs[node_id][pattern.input_index]
                if len(graph.node_inputs[node_id]) > pattern.input_index else None)
        elif isinstance(pattern, OpExpr):
            self.anchor_types = [(pattern.domain, pattern.op_type)]
            self.full_match = self._op_matcher(pattern)
            self.precheck = compile_precheck(pattern)
            self.match, self.viable = self._checked(self.precheck, self.full_match)
            self.anchors_at_node = True
            self.anchor_of = lambda graph, node_id: node_id
        else:
            raise TypeError("a rule's match must be an op pattern or a fan_out")

    @staticmethod
    def _first_of(alternatives):
        by_anchor: dict[tuple[str, str], list[CompiledPattern]] = {}
        for alt in alternatives:
            for key in alt.anchor_types:
                by_anchor.setdefault(key, []).append(alt)
        checks = {key: [(alt.precheck, alt.full_match) for alt in alts]
                  for key, alts in by_anchor.items()}

        def match(graph, node_id):
            misses = []
            for alt in by_anchor.get(graph.op_keys[node_id], ()):
                found = alt.match(graph, node_id)
                if not isinstance(found, Miss):
                    return found
                misses.append(found)
            return misses[0] if len(misses) == 1 else _JoinedMiss(misses)

        def viable(graph, node_id):
            return [full_match for precheck, full_match in checks.get(graph.op_keys[node_id], ())
                    if precheck is None or precheck(graph, node_id)]
        return match, viable

    @staticmethod
    def _checked(precheck, full_match):
        """match and viable for one op pattern: the pre-check, then the full matcher."""
        if precheck is None:
            always = (full_match,)
            return full_match, lambda graph, node_id: always

        def match(graph, node_id):
            if not precheck(graph, node_id):
                return _RecheckedMiss(full_match, graph, node_id)
            return full_match(graph, node_id)

        worth_it, none = (full_match,), ()

        def viable(graph, node_id):
            return worth_it if precheck(graph, node_id) else none
        return match, viable

    @staticmethod
    def _op_matcher(pattern: OpExpr):
        inner = compile_op(pattern)

        def full_match(graph, node_id):
            b = Bindings()
            miss = inner(graph, node_id, b)
            if miss is not None:
                return miss
            return b, [node_id]
        return full_match

    @staticmethod
    def _fan_out_matcher(pattern: FanOut):
        types = set(pattern.consumer_types)
        index, source = pattern.input_index, pattern.source.name

        def match(graph, tensor):
            op_keys, node_inputs = graph.op_keys, graph.node_inputs
            users = [u for u in graph.consumers.get(tensor, ())
                     if op_keys[u][1] in types and not op_keys[u][0]
                     and len(node_inputs[u]) > index and node_inputs[u][index] == tensor]
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

    __slots__ = ("graph", "id", "proto")

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

    __slots__ = ("graph", "name")

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
    """Attribute access to a pattern's bindings: ``m.a`` (tensor), ``m.t`` (node), ...

    Tensor, node and attribute bindings are set as instance attributes up front: views are
    cheap, and a lookup that fails over to ``__getattr__`` costs an AttributeError each
    time. Node lists are made on access (a fresh list each time: the rule may change it).
    A binding named like a Match attribute (``roots``, ``get``...) is shadowed by it."""

    def __init__(self, graph: Graph, bindings: Bindings, roots: list[int]):
        attributes = self.__dict__
        for name, kind in bindings.kinds.items():
            if kind == "tensor":
                attributes[name] = TensorView(graph, bindings[name])
            elif kind == "node":
                attributes[name] = NodeView(graph, bindings[name])
            elif kind != "nodes":
                attributes[name] = bindings[name]
        # Match's own attributes win over bindings of the same name: the instance ones are
        # set last, properties (graph, opset) win anyway, and the method is uncovered.
        attributes.pop("get", None)
        self._graph, self._bindings, self.roots = graph, bindings, roots
        self.nodes = bindings.nodes

    def __getattr__(self, name: str):
        try:
            value = self._bindings[name]
        except KeyError:
            raise AttributeError(f"pattern binds no '{name}'") from None
        if self._bindings.kinds[name] == "nodes":
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

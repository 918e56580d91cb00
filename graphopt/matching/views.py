"""What rules see of a match: views of the matched nodes and tensors, and the Match object
whose attributes are the pattern's bindings."""
from __future__ import annotations

import numpy as np

from ..ir import Graph


class NodeView:
    """A matched node as rules see it."""

    __slots__ = ("graph", "id")

    def __init__(self, graph: Graph, node_id: int):
        self.graph, self.id = graph, node_id

    proto = property(lambda self: self.graph.node(self.id))
    name = property(lambda self: self.graph.name_of(self.id))
    # from the index: reading the proto makes a Python string every time
    op_type = property(lambda self: self.graph.op_key(self.id)[1])
    domain = property(lambda self: self.graph.op_key(self.id)[0])
    inputs = property(lambda self: [TensorView(self.graph, n) for n in self.proto.input])
    outputs = property(lambda self: [TensorView(self.graph, n) for n in self.proto.output])

    def attr(self, name: str, default=None):
        return self.graph.attr(self.id, name, default)

    def input(self, index: int) -> TensorView | None:
        names = self.proto.input
        return TensorView(self.graph, names[index]) if index < len(names) and names[index] \
            else None

    def output(self, index: int) -> TensorView | None:
        names = self.proto.output
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
        node_id = self.graph.producer_of(self.name)
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

    Views are made on first access and kept as instance attributes (later reads are plain
    attribute hits): most rules read a few of their bindings, so building all of them up
    front is wasted. Node lists are made on every access (a fresh list each time: the rule
    may change it). A binding named like a Match attribute (``roots``, ``get``...) is
    shadowed by it. Generated matchers build a subclass made for their bindings
    (match_class), whose views come from descriptors rather than a failed lookup."""

    def __init__(self, graph: Graph, bindings: dict, kinds: dict, nodes: list,
                 roots: list[int]):
        self._graph, self._bindings, self._kinds = graph, bindings, kinds
        self.roots, self.nodes = roots, nodes

    def __getattr__(self, name: str):
        try:
            kind = self.__dict__["_kinds"][name]
        except KeyError:
            raise AttributeError(f"pattern binds no '{name}'") from None
        return _Binding(name, kind).__get__(self, type(self))

    def get(self, name: str, default=None):
        return getattr(self, name) if name in self._bindings else default

    @property
    def graph(self) -> Graph:
        return self._graph

    @property
    def opset(self) -> int:
        return self._graph.model.opset("") or 1


class _Binding:
    """A binding's view: ``make(graph, bound)`` on first access, then kept in the instance's
    __dict__ when ``keep`` (a non-data descriptor: the instance attribute wins from then on).
    ``kind`` names what ``make`` builds, see _MAKERS."""

    __slots__ = ("name", "make", "keep")

    def __init__(self, name: str, kind: str):
        self.name = name
        self.make, self.keep = _MAKERS.get(kind, _VALUE)

    def __get__(self, m, owner=None):
        if m is None:
            return self
        if not self.keep:
            return self.make(m._graph, m._bindings[self.name])
        value = m.__dict__[self.name] = self.make(m._graph, m._bindings[self.name])
        return value


_VALUE = (lambda graph, value: value, True)  # attributes, constants: the bound value itself
_MAKERS = {
    "tensor": (TensorView, True),
    "node": (NodeView, True),
    # a fresh list each time, as before: a caller may change the one it got
    "nodes": (lambda graph, ids: [NodeView(graph, i) for i in ids], False),
}
_OWN_NAMES = frozenset(dir(Match)) | {"_graph", "_bindings", "_kinds", "roots", "nodes"}


def bound_tensor(m: Match, name: str) -> str:
    """``getattr(m, name).name`` without making the view when ``name`` is a tensor binding
    not yet looked at (constraints ask for many names and use nothing else)."""
    try:
        if m._kinds.get(name) == "tensor" and name not in m.__dict__ \
                and name not in _OWN_NAMES:
            return m._bindings[name]
    except AttributeError:  # not a Match
        pass
    return getattr(m, name).name


def match_class(kinds: dict) -> type:
    """A Match subclass with a descriptor per binding of these kinds (names that Match
    itself uses stay Match's: they are shadowed, as with a plain Match)."""
    namespace = {}
    for name, kind in kinds.items():
        if name not in _OWN_NAMES and name.isidentifier():
            namespace[name] = _Binding(name, kind)
    return type("GeneratedMatch", (Match,), namespace)

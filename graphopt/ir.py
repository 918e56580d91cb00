"""The in-memory graph the engine rewrites: ONNX protos plus the indexes rules need.

Loaded nodes stay ``NodeProto`` objects (no conversion on load or save, which is what makes
a 40k-node model load, rewrite and save in well under a second); nodes a rewrite creates
stay PendingNode (what the rewrite said) until their proto is needed. Around them the graph
keeps a (domain, op_type) -> nodes index, tensor -> producer and tensor -> consumers, and an
order key per node so new nodes land where the nodes they replace stood. Every mutation goes
through a few primitives that journal their inverse, so a rewrite can be rolled back.
onnx-graphsurgeon is available for interop through :meth:`Model.to_graphsurgeon`.
"""
from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Iterator, Mapping
from sys import intern
from types import MappingProxyType

import numpy as np
import onnx
from onnx import numpy_helper

# TYPE_OF_INPUT, contrib_stand_ins, MS_DOMAIN and type_dims: the IR's to rules too (re-exported)
from .tensor_types import TYPE_OF_INPUT as TYPE_OF_INPUT
from .tensor_types import contrib_stand_ins as contrib_stand_ins
from .tensor_types import infer_types
from .vocabulary import MS_DOMAIN as MS_DOMAIN
from .vocabulary import (
    OPS_WITH_SUBGRAPHS,
    STANDARD_DOMAIN,
    STANDARD_DOMAIN_ALIAS,
    normalize_domain,
    subgraphs_of,
)
from .vocabulary import type_dims as type_dims

_A = onnx.AttributeProto
# (slicing a repeated field gives a list in one C call, about 2.5x faster than list())
_SIMPLE_ATTRIBUTE_VALUE = {_A.INT: lambda a: a.i, _A.FLOAT: lambda a: a.f,
                           _A.INTS: lambda a: a.ints[:], _A.FLOATS: lambda a: a.floats[:],
                           _A.STRING: lambda a: a.s}


def get_attr(node: onnx.NodeProto, name: str, default=None):
    """An attribute's value as onnx.helper.get_attribute_value gives it (rules read
    attributes in their hottest paths, so the common kinds skip the generic helper).
    The field is sliced first: iterating a list is ~200 ns cheaper than iterating the
    protobuf field itself."""
    for attr in node.attribute[:]:
        if attr.name == name:
            simple = _SIMPLE_ATTRIBUTE_VALUE.get(attr.type)
            return simple(attr) if simple else onnx.helper.get_attribute_value(attr)
    return default


_GRAPH_ATTRIBUTE_TYPES = (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)




def has_subgraphs(node: onnx.NodeProto, domain: str | None = None,
                  op_type: str | None = None) -> bool:
    """``domain`` and ``op_type``: the node's, if the caller has them (a proto's string
    fields make a new str at each read)."""
    if domain is None:
        domain, op_type = node.domain, node.op_type
    known = OPS_WITH_SUBGRAPHS.get(domain)
    if known is not None:
        return op_type in known
    if type(node) is PendingNode:
        node = node.template
    return any(a.type in _GRAPH_ATTRIBUTE_TYPES for a in node.attribute)


def nested_nodes(graph: onnx.GraphProto, depth: int = 0) -> Iterator[tuple[onnx.NodeProto, int]]:
    """Every node of ``graph`` and of its subgraphs (If/Loop/Scan bodies), with its depth
    (0: ``graph`` itself)."""
    for node in graph.node:
        yield node, depth
        for sub in subgraphs_of(node):
            yield from nested_nodes(sub, depth + 1)


def free_variables(graph: onnx.GraphProto) -> list[str]:
    """Outer-scope tensors a subgraph reads: they count as inputs of the node that owns it."""
    defined = {i.name for i in graph.input} | {t.name for t in graph.initializer}
    free: dict[str, None] = {}
    for node in graph.node:
        for sub in subgraphs_of(node):
            for name in free_variables(sub):
                if name not in defined:
                    free[name] = None
        for name in node.input:
            if name and name not in defined:
                free[name] = None
        defined.update(node.output)
    return list(free)


def _graph_tensors(graph: onnx.GraphProto):
    yield from graph.initializer
    for sparse in graph.sparse_initializer:
        yield sparse.values
        yield sparse.indices
    yield from _node_tensors(graph.node)


_A_KINDS_WITH_TENSORS = frozenset({
    onnx.AttributeProto.TENSOR, onnx.AttributeProto.TENSORS, onnx.AttributeProto.SPARSE_TENSOR,
    onnx.AttributeProto.SPARSE_TENSORS, onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS,
    onnx.AttributeProto.UNDEFINED})  # (an attribute without its type: looked at in full)


def _node_tensors(nodes):
    for node in nodes:
        for attr in node.attribute:
            if attr.type not in _A_KINDS_WITH_TENSORS:
                continue  # ints, floats, strings: most attributes, skipped on their kind
            if attr.HasField("t"):
                yield attr.t
            yield from attr.tensors
            for sparse in [attr.sparse_tensor, *attr.sparse_tensors]:
                yield sparse.values
                yield sparse.indices
            if attr.HasField("g"):
                yield from _graph_tensors(attr.g)
            for sub in attr.graphs:
                yield from _graph_tensors(sub)


def external_tensors(proto: onnx.ModelProto) -> list[onnx.TensorProto]:
    """Every tensor whose bytes live in an external file: initializers (dense and sparse) and
    tensor attributes of the graph, its subgraphs, the model's local functions and its
    training info, in a fixed order (two copies of one model list them alike)."""
    def everywhere():
        yield from _graph_tensors(proto.graph)
        for function in proto.functions:
            yield from _node_tensors(function.node)
        for info in proto.training_info:
            yield from _graph_tensors(info.initialization)
            yield from _graph_tensors(info.algorithm)
    return [t for t in everywhere() if t.data_location == onnx.TensorProto.EXTERNAL]


def constant_node_value(node: onnx.NodeProto, max_elements: int = 1 << 30
                        ) -> np.ndarray | None:
    """The value a Constant node holds (its one value attribute: value, value_float(s),
    value_int(s)), None for another kind (sparse, strings) or more than ``max_elements``.
    Annotations such as __backwardpass do not change what a Constant holds."""
    values = [a for a in node.attribute if not a.name.startswith("__")]
    attr = values[0] if len(values) == 1 else None
    if attr is None:
        return None
    if attr.name == "value":
        if int(np.prod(attr.t.dims)) > max_elements:
            return None
        return numpy_helper.to_array(attr.t)
    if attr.name in ("value_floats", "value_ints") and len(
            attr.floats if attr.name == "value_floats" else attr.ints) > max_elements:
        return None
    if attr.name in ("value_float", "value_int", "value_floats", "value_ints"):
        return np.array(onnx.helper.get_attribute_value(attr),
                        dtype=np.float32 if "float" in attr.name else np.int64)
    return None


class NameGenerator:
    """Fresh names, unique across the whole model (all scopes), deterministic."""

    def __init__(self, used: Iterable[str]):
        self.used = set(used)
        self._next: dict[str, int] = {}

    def fresh(self, hint: str) -> str:
        used = self.used
        n = self._next.get(hint)  # a hint seen before is used: skip testing it
        if n is None:
            if hint not in used:
                used.add(hint)
                return hint
            n = 1
        name = f"{hint}_{n}"
        while name in used:
            n += 1
            name = f"{hint}_{n}"
        self._next[hint] = n + 1
        used.add(name)
        return name


def _all_names(graph: onnx.GraphProto) -> Iterator[str]:
    for vi in itertools.chain(graph.input, graph.output, graph.value_info):
        yield vi.name
    for t in graph.initializer:
        yield t.name
    for sparse in graph.sparse_initializer:  # its name is its values tensor's
        yield sparse.values.name
    for node in graph.node:
        if node.name:
            yield node.name
        yield from node.output
        for sub in subgraphs_of(node):
            yield from _all_names(sub)


def graph_names(graph: onnx.GraphProto) -> Iterator[str]:
    """Every name a graph proto uses, its subgraphs' included: what a fresh name avoids."""
    return _all_names(graph)


def _all_names_indexed(graph: Graph) -> Iterator[str]:
    """_all_names of an indexed graph, reading output names from its index and looking
    for subgraphs only in the nodes that have them."""
    proto = graph.proto
    for vi in itertools.chain(proto.input, proto.output, proto.value_info):
        yield vi.name
    yield from graph._initializers
    for sparse in proto.sparse_initializer:
        yield sparse.values.name
    for node in proto.node:
        if node.name:
            yield node.name
    for outputs in graph._node_outputs.values():
        yield from outputs
    for node_id in graph._subgraph_owners:
        for sub in subgraphs_of(graph.node(node_id)):
            yield from _all_names(sub)


def _refines(old: onnx.TypeProto, new: onnx.TypeProto) -> bool:
    """``new`` says everything ``old`` says about a tensor, and more (a rank, a number
    where ``old`` had a symbol or nothing)."""
    if not (old.HasField("tensor_type") and new.HasField("tensor_type")):
        return False
    a, b = old.tensor_type, new.tensor_type
    if a.elem_type and a.elem_type != b.elem_type:
        return False
    if a.HasField("shape"):
        if not b.HasField("shape") or len(a.shape.dim) != len(b.shape.dim):
            return False
        for x, y in zip(a.shape.dim, b.shape.dim, strict=True):
            if x.HasField("dim_value") and not (y.HasField("dim_value")
                                                and y.dim_value == x.dim_value):
                return False

    def facts(t):
        return (bool(t.elem_type) + t.HasField("shape")
                + sum(d.HasField("dim_value") for d in t.shape.dim))
    return facts(b) > facts(a)


_TEMPLATES: dict = {}


def node_template(op_type: str, domain: str, attrs: dict) -> onnx.NodeProto:
    """A node with these attributes and no name or edges; rules create the same kinds of
    node over and over, and copying a template is several times cheaper than building."""
    try:  # types in the key: 1, 1.0 and True are equal but make different attributes
        key = (op_type, domain, *attrs.items(), *map(type, attrs.values()))
        template = _TEMPLATES.get(key)
    except TypeError:  # a list (ints, floats, strings) or an unhashable value
        key, template = _list_template_key(op_type, domain, attrs), None
        if key is not None:
            template = _TEMPLATES.get(key)
    if template is None:
        template = onnx.helper.make_node(op_type, [], [], domain=domain or None,
                                         **{k: v for k, v in attrs.items() if v is not None})
        if key is not None and len(_TEMPLATES) < 4096:
            _TEMPLATES[key] = template
    return template


def _list_template_key(op_type: str, domain: str, attrs: dict):
    """A key for attributes with list values (as tuples), or None if still unhashable
    (tensors, graphs: no caching). Three items long where a plain key has an even
    length, so the two never meet."""
    key = (op_type, domain, tuple((k, tuple(v) if isinstance(v, list) else v, type(v))
                                  for k, v in attrs.items()))
    try:
        hash(key)
    except TypeError:
        return None
    return key


class PendingNode:
    """A node a rewrite created, held as the rewrite described it (op type, domain,
    attributes, name, edges) until something needs its NodeProto.

    Building a proto (an allocation, a copy of every attribute, string fields) costs as much
    as the rest of a typical rewrite, and most new nodes are next read when the model is
    written out, where Graph.flush builds them straight into the output. A pending node
    answers the fields rules and labels read most (name, op_type, domain, input, output);
    Graph.attr reads its attributes from its template, and everything else goes through
    ``Graph.node(node_id)``, which builds the proto then. Only nodes without subgraphs or
    per-node annotations are kept pending, so ``attrs`` is every attribute the node has."""

    __slots__ = ("op_type", "domain", "attrs", "name", "input", "output", "_template")

    def __init__(self, op_type: str, domain: str, attrs: dict, name: str,
                 inputs: tuple[str, ...], outputs: tuple[str, ...]):
        self.op_type, self.domain, self.attrs = op_type, domain, attrs
        self.name, self.input, self.output = name, inputs, outputs
        self._template = None

    @property
    def template(self) -> onnx.NodeProto:
        """The node without name and edges (shared by nodes with the same attributes)."""
        if self._template is None:
            self._template = node_template(self.op_type, self.domain, self.attrs)
        return self._template

    def write(self, node: onnx.NodeProto) -> onnx.NodeProto:
        """Fill the empty ``node`` with this node's contents."""
        node.CopyFrom(self.template)
        node.name = self.name
        node.input.extend(self.input)
        node.output.extend(self.output)
        return node


def _any_used(tensors, consumers: dict, protected: set) -> bool:
    for name in tensors:
        if name and (name in protected or consumers.get(name)):
            return True
    return False


class Graph:
    """One graph scope with its indexes. Node ids are stable ints; order keys are tuples.

    The indexes are private: callers ask questions (op_key, inputs_of, outputs_of,
    producer_of, consumers_of, nodes_of_type, order_of, attr, constant_value, elem_type,
    static_shape, type_of, read_by_subgraph, ...) and change the graph through the
    journaled primitives (add_node, replace_node, remove_node, replace_input, ...).
    tests/ir/test_ir_api.py fails if code outside this module touches a private name."""

    def __init__(self, proto: onnx.GraphProto, model: Model):
        self.proto = proto
        self.model = model
        # node id -> NodeProto, or PendingNode for one a rewrite made whose proto nobody
        # has needed yet: read a node through node(), which builds it then
        self._nodes: dict[int, onnx.NodeProto | PendingNode] = {}
        self._node_view = MappingProxyType(self._nodes)
        self._order: dict[int, tuple] = {}
        self._by_type: dict[tuple[str, str], dict[int, None]] = {}
        self._producer: dict[str, int] = {}
        self._consumers: dict[str, dict[int, None]] = {}
        self._op_keys: dict[int, tuple[str, str]] = {}  # node id -> its key in by_type
        # Each node's input and output names, read from the proto once: a protobuf string
        # field makes (and decodes) a new str at every access, which would dominate the
        # matcher and the index updates. The mutation primitives keep them current.
        # Names read from the proto are interned, so every copy of a name is one object:
        # a dict compares keys by identity before comparing text, and in a large graph's
        # indexes (bigger than the CPU caches) the text compare cost a cache miss a probe.
        self._node_inputs: dict[int, tuple[str, ...]] = {}
        self._node_outputs: dict[int, tuple[str, ...]] = {}
        self._subgraph_owners: dict[int, None] = {}  # nodes with graph attributes
        self._initializers: dict[str, onnx.TensorProto] = {intern(t.name): t
                                                          for t in proto.initializer}
        self.input_names = [intern(i.name) for i in proto.input]
        self._input_set = frozenset(self.input_names)  # for membership tests in hot paths
        self.output_names = [intern(o.name) for o in proto.output]
        self._protected = set(self.output_names)
        self._types: dict[str, onnx.TypeProto] = {}
        for vi in itertools.chain(proto.input, proto.output, proto.value_info):
            if vi.type.HasField("tensor_type"):
                self._types[intern(vi.name)] = vi.type
        # Shapes the file declares for outputs and intermediates are claims, not facts (a
        # value_info can say [2,6,4] where the inputs give [B,S,4]): before a rule sees a
        # shape they are replaced by what inference from the graph's inputs finds.
        self._declared = {name for name, tp in self._types.items()
                          if name not in self._input_set and tp.tensor_type.HasField("shape")}
        self._implicit: dict[int, list[str]] = {}
        self._scratch: onnx.GraphProto | None = None  # holds the nodes new_node makes
        self.journal: list | None = None
        # The read API's hottest questions, answered by the indexes' own bound methods (a
        # Python method around them costs a call frame, and the matchers and the engine ask
        # them at every candidate; the dicts are never replaced, so these stay current):
        # op_key(node_id): the node's (normalized domain, op_type); None once removed
        self.op_key = self._op_keys.get
        # inputs_of(node_id) / outputs_of(node_id): its edge names ("" for an absent one)
        self.inputs_of = self._node_inputs.__getitem__
        self.outputs_of = self._node_outputs.__getitem__
        # producer_of(tensor): the node producing it; None for a graph input, an
        # initializer, a name from the outer scope or no tensor at all
        self.producer_of = self._producer.get
        # order_of(node_id): its sort key (nodes are written out in this order)
        self.order_of = self._order.__getitem__
        for node_id, node in enumerate(proto.node):
            self._index(node, (node_id,), node_id)
        self._ids = itertools.count(len(self._nodes))
        self.changed = False

    # ---- reading -------------------------------------------------------------------
    @property
    def nodes(self) -> Mapping[int, onnx.NodeProto | PendingNode]:
        """node id -> its NodeProto or PendingNode, read-only (the matcher's fast lookups):
        nodes change only through the journaled primitives below, which a rollback undoes."""
        return self._node_view

    def node(self, node_id: int) -> onnx.NodeProto:
        """The node's proto (built now if the node is pending)."""
        node = self._nodes[node_id]
        if type(node) is PendingNode:
            node = self._nodes[node_id] = node.write(self.new_node())
        return node

    def attr(self, node_id: int, name: str, default=None):
        """An attribute of the node, as get_attr reads it (a pending node's template holds
        all its attributes: no need to build it)."""
        node = self._nodes[node_id]
        return get_attr(node.template if type(node) is PendingNode else node, name, default)

    def nodes_of_type(self, op_type: str, domain: str = STANDARD_DOMAIN) -> list[int]:
        return list(self._by_type.get((domain, op_type), ()))

    def consumers_of(self, tensor: str) -> list[int]:
        """The nodes reading ``tensor`` (an input, or by name from a subgraph), a copy."""
        return list(self._consumers.get(tensor, ()))

    def consumer_count(self, tensor: str) -> int:
        return len(self._consumers.get(tensor, ()))

    def neighbours(self, node_ids, tensors=()) -> dict[int, None]:
        """The nodes around ``node_ids`` (themselves, their inputs' producers and readers,
        their outputs' readers) and the readers of ``tensors``, in that order, once each."""
        producer, consumers = self._producer, self._consumers
        found = dict.fromkeys(node_ids)
        for node_id in node_ids:
            for name in self._node_inputs[node_id]:
                if name in producer:
                    found[producer[name]] = None
                users = consumers.get(name)
                if users:
                    found.update(users)
            for name in self._node_outputs[node_id]:
                users = consumers.get(name)
                if users:
                    found.update(users)
        for name in tensors:
            users = consumers.get(name)
            if users:
                found.update(users)
        return found

    def has_tensor(self, tensor: str) -> bool:
        """Whether a node of this scope produces or reads ``tensor``."""
        return tensor in self._producer or tensor in self._consumers

    def op_counts(self) -> dict[tuple[str, str], int]:
        """(domain, op_type) -> how many nodes of this scope have it (none: left out)."""
        return {key: len(ids) for key, ids in self._by_type.items() if ids}

    def index_snapshot(self) -> tuple:
        """Copies of every index (op types, edges, producers, consumers, order), equal for
        two graphs indexed alike: for checking that a rollback restored them."""
        return (dict(self._op_keys), dict(self._node_inputs), dict(self._node_outputs),
                dict(self._producer), {k: dict(v) for k, v in self._consumers.items()},
                {k: dict(v) for k, v in self._by_type.items() if v}, dict(self._order))

    def has_node(self, node_id: int) -> bool:
        return node_id in self._nodes

    def is_used(self, tensor: str) -> bool:
        """Whether a node (or a subgraph) reads ``tensor`` or it is a graph output."""
        return tensor in self._protected or bool(self._consumers.get(tensor))

    def implicit_inputs(self, node_id: int) -> list[str]:
        """The outer-scope tensors the node's subgraphs read by name (If/Loop bodies)."""
        return list(self._implicit.get(node_id, ()))

    def read_by_subgraph(self, tensor: str) -> bool:
        """Whether a subgraph (an If/Loop body) reads ``tensor`` by name from this scope:
        rewiring node inputs cannot reach such a use, so the name must stay."""
        implicit = self._implicit
        return bool(implicit) and any(tensor in implicit.get(user, ())
                                      for user in self._consumers.get(tensor, ()))

    def owns_subgraphs(self, node_id: int) -> bool:
        return node_id in self._subgraph_owners

    def subgraph_owner_ids(self) -> list[int]:
        """The nodes with graph attributes (If, Loop, ...), in the order they were indexed."""
        return list(self._subgraph_owners)

    def is_initializer(self, tensor: str) -> bool:
        return tensor in self._initializers

    def initializer(self, tensor: str) -> onnx.TensorProto | None:
        return self._initializers.get(tensor)

    def initializer_count(self) -> int:
        return len(self._initializers)

    def initializer_names(self) -> list[str]:
        return list(self._initializers)

    def node_count(self) -> int:
        return len(self._nodes)

    def name_of(self, node_id: int) -> str:
        """The node's name ("" if unnamed), read without building a pending node."""
        return self._nodes[node_id].name

    def carried_attributes(self, node_id: int, names) -> list[onnx.AttributeProto]:
        """The node's attributes named in ``names`` (annotations such as __backwardpass
        that a replacement carries on). A pending node has none: it holds only what the
        rewrite that made it gave it."""
        node = self._nodes[node_id]
        if type(node) is PendingNode:
            return []
        attributes = node.attribute
        if not attributes:  # the common case, without building a list
            return []
        return [attr for attr in attributes if attr.name in names]

    def is_defined(self, tensor: str) -> bool:
        """Produced by a node, or an initializer or graph input of this scope."""
        return tensor in self._producer or tensor in self._initializers or tensor in self._input_set

    def type_of(self, tensor: str) -> onnx.TypeProto | None:
        """The tensor's type as known (declared inputs, inference, rewrites), or None."""
        return self._types.get(tensor)

    def sorted_ids(self) -> list[int]:
        return sorted(self._nodes, key=self._order.__getitem__)

    def is_graph_input(self, tensor: str) -> bool:
        return tensor in self._input_set

    def is_output(self, tensor: str) -> bool:
        return tensor in self._protected

    def constant_value(self, tensor: str, max_elements: int = 1 << 20) -> np.ndarray | None:
        """The value of an initializer or Constant-node output, if small enough to look at.

        An initializer that is also a graph input can be overridden at run time, so it is
        not a constant."""
        init = self._initializers.get(tensor)
        if init is not None:
            if tensor in self._input_set or int(np.prod(init.dims)) > max_elements:
                return None
            if init.data_location == onnx.TensorProto.EXTERNAL:
                return self.model.external_array(init)
            return numpy_helper.to_array(init)
        node_id = self._producer.get(tensor)
        if node_id is None:
            return None
        node = self._nodes[node_id]
        if node.op_type != "Constant" or normalize_domain(node.domain):
            return None
        return constant_node_value(self.node(node_id), max_elements)

    def elem_type(self, tensor: str, infer: bool = True) -> int | None:
        """Element type; with ``infer``, runs whole-model inference once if it must."""
        tp = self._types.get(tensor)
        if tp is not None:
            return tp.tensor_type.elem_type or None
        init = self._initializers.get(tensor)
        if init is not None:
            return init.data_type
        node_id = self._producer.get(tensor)
        if node_id is not None and self._nodes[node_id].op_type == "Constant":
            value = self.constant_value(tensor, max_elements=1 << 30)
            if value is not None:
                return onnx.helper.np_dtype_to_tensor_dtype(value.dtype)
        if infer and self.model.infer_types():
            return self.elem_type(tensor, infer=False)
        return None

    def verify_declared(self, names: Iterable[str] | None = None) -> None:
        """Replace the declared (value_info, output) types of ``names`` (default: all) by
        the ones inference from the graph's inputs gives; a declared shape inference cannot
        confirm is dropped. The first call runs whole-model inference, so it is made only
        for a name a rule or a rewrite asks about."""
        if names is None:
            declared, self._declared = self._declared, set()
        else:
            declared = [n for n in names if n in self._declared]
            if not declared:
                return
            self._declared.difference_update(declared)
        if not declared:
            return
        found = self.model.inferred_types()
        for name in declared:
            if name in self._initializers:
                continue  # a value's type is exact (a fold may have made it since inference)
            tp = found.get(name)
            old = self._types.get(name)
            if old is None:
                continue
            if tp is None or not tp.HasField("tensor_type"):
                tp = onnx.TypeProto()
                tp.tensor_type.elem_type = old.tensor_type.elem_type
            self._types[name] = tp

    def static_shape(self, tensor: str, infer: bool = True) -> list[int | None] | None:
        """Shape with None for unknown dims, or None when even the rank is unknown: from the
        graph's inputs, initializers and inference, never from a declaration alone."""
        if tensor in self._declared:
            self.verify_declared((tensor,))
        tp = self._types.get(tensor)
        if tp is not None and tp.tensor_type.HasField("shape"):
            return [d.dim_value if d.HasField("dim_value") else None
                    for d in tp.tensor_type.shape.dim]
        init = self._initializers.get(tensor)
        if init is not None:
            return list(init.dims)
        if infer and self.model.infer_types():
            return self.static_shape(tensor, infer=False)
        return None

    # ---- indexing ----------------------------------------------------------------
    def _index(self, node: onnx.NodeProto, order: tuple, node_id: int | None = None,
               edges: tuple[tuple[str, ...], tuple[str, ...]] | None = None,
               key: tuple[str, str] | None = None) -> int:
        node_id = next(self._ids) if node_id is None else node_id
        self._nodes[node_id] = node
        self._order[node_id] = order
        if key is None:
            domain, op_type = node.domain, node.op_type
            key = (STANDARD_DOMAIN if domain == STANDARD_DOMAIN_ALIAS else domain, op_type)
        else:
            domain, op_type = key
        self._op_keys[node_id] = key
        by_type = self._by_type.get(key)
        if by_type is None:
            by_type = self._by_type[key] = {}
        by_type[node_id] = None
        if edges is None:  # (a slice first: iterating the protobuf field itself is slower)
            inputs, outputs = tuple(map(intern, node.input[:])), \
                tuple(map(intern, node.output[:]))
        else:
            inputs, outputs = edges
        self._node_inputs[node_id], self._node_outputs[node_id] = inputs, outputs
        producer, consumers = self._producer, self._consumers
        for name in outputs:
            if name:
                producer[name] = node_id
        for name in inputs:
            if name:
                users = consumers.get(name)
                if users is None:
                    consumers[name] = {node_id: None}
                else:
                    users[node_id] = None
        known = OPS_WITH_SUBGRAPHS.get(domain)  # inlined has_subgraphs: this runs per node
        if (op_type in known) if known is not None else has_subgraphs(node):
            self._index_subgraphs(node_id, node)
        return node_id

    def _index_subgraphs(self, node_id: int, node: onnx.NodeProto) -> None:
        """Outer-scope tensors the node's subgraphs read count as its inputs."""
        self._subgraph_owners[node_id] = None
        implicit = [n for sub in subgraphs_of(node) for n in free_variables(sub)]
        if implicit:
            self._implicit[node_id] = implicit
            for name in implicit:
                self._consumers.setdefault(name, {})[node_id] = None

    def _unindex(self, node_id: int) -> onnx.NodeProto:
        node = self._nodes.pop(node_id)
        del self._order[node_id]
        self._by_type[self._op_keys.pop(node_id)].pop(node_id)
        inputs = self._node_inputs.pop(node_id)
        producer, consumers = self._producer, self._consumers
        for name in self._node_outputs.pop(node_id):
            if name and producer.get(name) == node_id:
                del producer[name]
        # both are empty in most graphs: test before calling pop
        if self._subgraph_owners:
            self._subgraph_owners.pop(node_id, None)
        implicit = self._implicit.pop(node_id, None) if self._implicit else None
        for name in inputs if implicit is None else itertools.chain(inputs, implicit):
            users = consumers.get(name)
            if users is not None:
                users.pop(node_id, None)
                if not users:
                    del consumers[name]
        return node

    def new_node(self, template: onnx.NodeProto | None = None) -> onnx.NodeProto:
        """A new, not yet added NodeProto (a copy of ``template`` if given). It is made in
        one shared scratch message: a standalone message costs an allocation of its own,
        several times the price of the copy, and rewrites create nodes by the thousand."""
        if self._scratch is None:
            self._scratch = onnx.GraphProto()
        node = self._scratch.node.add()
        if template is not None:
            node.CopyFrom(template)
        return node

    # ---- journaled mutations -----------------------------------------------------------
    # The journal holds (undo function, *arguments) tuples: cheaper to record than closures,
    # and rewrites record several per transaction.
    def _log(self, undo, *args) -> None:
        self.changed = True
        if self.journal is not None:
            self.journal.append((undo, *args))

    def add_node(self, node: onnx.NodeProto, order: tuple,
                 edges: tuple[tuple[str, ...], tuple[str, ...]] | None = None,
                 key: tuple[str, str] | None = None) -> int:
        """Add ``node`` at ``order``. ``edges``, if given, must be the node's (inputs,
        outputs) as tuples, and ``key`` its (normalized domain, op_type): a caller that has
        just written them saves reading them back."""
        node_id = self._index(node, order, None, edges, key)
        self.changed = True
        if self.journal is not None:
            self.journal.append((self._unindex, node_id))
        return node_id

    def replace_node(self, node_id: int, node: onnx.NodeProto | PendingNode,
                     inputs: tuple[str, ...], key: tuple[str, str]) -> None:
        """Put ``node`` (reading ``inputs``, with op key ``key``) in the place of node
        ``node_id``: same id, same order, same outputs, so only what differs is
        re-indexed. Neither node may have subgraphs."""
        if node_id in self._subgraph_owners or has_subgraphs(node, *key):
            raise ValueError("replace_node: a node with subgraphs is removed and added instead")
        old_key, old_inputs = self._op_keys[node_id], self._node_inputs[node_id]
        self.changed = True
        if self.journal is not None:  # (rollback runs without a journal: no re-recording)
            self.journal.append((self.replace_node, node_id, self._nodes[node_id], old_inputs,
                                 old_key))
        self._nodes[node_id] = node
        if key != old_key:
            self._by_type[old_key].pop(node_id)
            by_type = self._by_type.get(key)
            if by_type is None:
                by_type = self._by_type[key] = {}
            by_type[node_id] = None
            self._op_keys[node_id] = key
        if inputs != old_inputs:
            consumers = self._consumers
            for name in old_inputs:
                if name and name not in inputs:
                    users = consumers[name]
                    users.pop(node_id, None)
                    if not users:
                        del consumers[name]
            for name in inputs:
                if name and name not in old_inputs:
                    users = consumers.get(name)
                    if users is None:
                        consumers[name] = {node_id: None}
                    else:
                        users[node_id] = None
            self._node_inputs[node_id] = inputs

    def remove_node(self, node_id: int) -> None:
        order = self._order[node_id]
        node = self._unindex(node_id)
        self.changed = True
        if self.journal is not None:
            self.journal.append((self._index, node, order, node_id))

    def redirect_readers(self, old: str, new: str) -> None:
        """Every node input reading ``old`` reads ``new`` instead (a subgraph reading
        ``old`` by name is not reached: ask read_by_subgraph first)."""
        for reader in self.consumers_of(old):
            for index, name in enumerate(self._node_inputs[reader]):
                if name == old:
                    self.replace_input(reader, index, new)

    def replace_input(self, node_id: int, index: int, tensor: str) -> None:
        old = self._node_inputs[node_id][index]
        self._set_input(node_id, index, tensor)
        self._log(self._set_input, node_id, index, old)

    def _set_input(self, node_id: int, index: int, tensor: str) -> None:
        inputs = list(self._node_inputs[node_id])
        old = inputs[index]
        self.node(node_id).input[index] = inputs[index] = tensor
        self._node_inputs[node_id] = tuple(inputs)
        if old and old not in inputs and old not in self._implicit.get(node_id, ()):
            users = self._consumers[old]
            users.pop(node_id, None)
            if not users:
                del self._consumers[old]
        if tensor:
            self._consumers.setdefault(tensor, {})[node_id] = None

    def add_initializer(self, tensor: onnx.TensorProto) -> None:
        self._initializers[tensor.name] = tensor
        self._log(self._initializers.pop, tensor.name)
        # A folded tensor's type may have been inferred with unknown dims while it was
        # computed; its value's type is exact.
        exact = onnx.helper.make_tensor_type_proto(tensor.data_type, list(tensor.dims))
        if self._types.get(tensor.name) != exact:
            self.set_type(tensor.name, exact)

    def remove_initializer(self, name: str) -> None:
        tensor = self._initializers.pop(name)
        self._log(self._initializers.__setitem__, name, tensor)

    def set_attribute(self, node_id: int, attr: onnx.AttributeProto) -> None:
        node = self.node(node_id)
        previous = [a for a in node.attribute if a.name == attr.name]
        saved = onnx.AttributeProto()
        if previous:
            saved.CopyFrom(previous[0])
        self._put_attribute(node, attr)
        if attr.type in _GRAPH_ATTRIBUTE_TYPES:
            self._subgraph_owners[node_id] = None  # a stale entry is harmless: none found

        def undo():
            if previous:
                self._put_attribute(node, saved)
            else:
                kept = [a for a in node.attribute if a.name != attr.name]
                del node.attribute[:]
                node.attribute.extend(kept)
        self._log(undo)

    @staticmethod
    def _put_attribute(node: onnx.NodeProto, attr: onnx.AttributeProto) -> None:
        for existing in node.attribute:
            if existing.name == attr.name:
                existing.CopyFrom(attr)
                return
        node.attribute.append(attr)

    def set_type(self, tensor: str, type_proto: onnx.TypeProto) -> None:
        old = self._types.get(tensor)
        self._types[tensor] = type_proto
        if old is None:
            self._log(self._types.pop, tensor)
        else:
            self._log(self._types.__setitem__, tensor, old)

    def remove_dead(self, candidates: Iterable[str]) -> list[str]:
        """Delete the producers (and initializers) of these tensors if nothing reads them
        any more, and so on upstream; returns the tensors whose producers went away."""
        consumers, protected, producers = self._consumers, self._protected, self._producer
        dead_tensors = []
        stack = list(candidates)  # a repeated name is harmless: found gone the second time
        while stack:
            name = stack.pop()
            if not name or name in protected or consumers.get(name):
                continue
            producer = producers.get(name)
            if producer is not None:
                outputs = self._node_outputs[producer]
                # (a single output is ``name``, just found unused)
                if len(outputs) > 1 and _any_used(outputs, consumers, protected):
                    continue
                inputs = self._node_inputs[producer]
                self.remove_node(producer)
                dead_tensors.append(name)
                stack.extend(inputs)
            elif name in self._initializers and name not in self._input_set:
                self.remove_initializer(name)
        return dead_tensors

    # ---- transactions ------------------------------------------------------------------
    def begin(self) -> None:
        self.journal = []
        self._changed_before = self.changed
        self._flushed_in_transaction = False

    def commit(self) -> None:
        self.journal = None

    def rollback(self) -> None:
        journal, self.journal = self.journal, None
        for undo, *args in reversed(journal):
            undo(*args)
        # A flush inside the transaction (a whole-model check) wrote the rolled-back state
        # into the proto: the next flush must overwrite it.
        self.changed = self._changed_before or self._flushed_in_transaction

    # ---- writing back --------------------------------------------------------------
    def _flush_initializers(self) -> None:
        """The proto's initializers become the table's, in its order. A tensor the proto
        already holds stays where it is: protobuf copies every message it is given, and the
        weights are most of a model's bytes. So the removed ones are deleted and the added
        ones appended (the table then holds the proto's copy)."""
        out, wanted = self.proto.initializer, self._initializers
        for index in range(len(out) - 1, -1, -1):
            tensor = out[index]
            if wanted.get(tensor.name) is not tensor:
                del out[index]  # removed, or replaced by another tensor of that name
        present = {tensor.name for tensor in out}
        for name, tensor in wanted.items():
            if name not in present:
                out.append(tensor)
                wanted[name] = out[len(out) - 1]
        if [tensor.name for tensor in out] != list(wanted):  # a name re-added earlier on
            kept = list(wanted.values())
            del out[:]
            out.extend(kept)
            for index, name in enumerate(wanted):
                wanted[name] = out[index]

    def flush(self) -> None:
        """Write the nodes (in order) and initializers back into the proto, and drop the
        value_info of tensors no node produces or reads any more (types are not written:
        whoever needs them infers them)."""
        if not self.changed:
            return
        if self.journal is not None:
            self._flushed_in_transaction = True
        nodes, out = self._nodes, self.proto.node
        ordered = [nodes[i] for i in self.sorted_ids()]
        del out[:]
        run_start = 0  # protos are appended in runs: extend is one C call per run
        for i, node in enumerate(ordered):
            if type(node) is PendingNode:
                out.extend(ordered[run_start:i])
                node.write(out.add())
                run_start = i + 1
        out.extend(ordered[run_start:])
        self._flush_initializers()
        live = set(self._producer) | set(self._consumers)
        stale = [vi for vi in self.proto.value_info if vi.name not in live]
        if stale:
            kept = [vi for vi in self.proto.value_info if vi.name in live]
            del self.proto.value_info[:]
            self.proto.value_info.extend(kept)


class Model:
    """A loaded ONNX model: the proto, where it came from, and its graph."""

    def __init__(self, proto: onnx.ModelProto, path: str | None = None):
        import os

        self.proto = proto
        self.path = path
        self._opsets: dict[str, int] | None = None
        self.base_dir = os.path.dirname(os.path.abspath(path)) if path else ""
        self.external = None  # graphopt.modelio.ExternalFiles once its data files are opened
        self.graph = Graph(proto.graph, self)
        self.names = NameGenerator(_all_names_indexed(self.graph))
        self._subgraphs: dict[int, Graph] = {}
        self._inferred = False
        self._found: dict[str, onnx.TypeProto] | None = None
        self.inference_seconds = 0.0  # spent in whole-model inference (optimize --profile)

    @property
    def ir_version(self) -> int:
        return self.proto.ir_version

    @property
    def opsets(self) -> dict[str, int]:
        if self._opsets is None:
            self._opsets = {normalize_domain(o.domain): o.version
                            for o in self.proto.opset_import}
        return self._opsets

    def opset(self, domain: str = STANDARD_DOMAIN) -> int | None:
        return self.opsets.get(domain)

    def ensure_opset(self, domain: str, version: int = 1) -> bool:
        if domain in self.opsets:
            return False
        self.proto.opset_import.append(onnx.helper.make_opsetid(domain, version))
        self._opsets = None
        return True

    def graphs(self) -> Iterator[Graph]:
        """The main graph, then every subgraph (depth first), each wrapped once."""
        yield from self._walk(self.graph)

    def _walk(self, graph: Graph) -> Iterator[Graph]:
        yield graph
        owners = sorted(graph._subgraph_owners, key=graph._order.__getitem__)
        for node_id in owners:
            for sub in subgraphs_of(graph.node(node_id)):
                key = id(sub)
                if key not in self._subgraphs:
                    self._subgraphs[key] = Graph(sub, self)
                yield from self._walk(self._subgraphs[key])

    def infer_types(self) -> bool:
        """Fill every graph's type table from ONNX shape inference (with data propagation,
        so shapes computed from Shape/Concat/... become static). Runs at most once per
        model; types of tensors created later come from per-node inference."""
        if self._inferred:
            return False
        self._inferred = True
        found = self.inferred_types()
        if not found:
            return False
        self._merge_types(found, refine=False)
        return True

    def refresh_types(self) -> int:
        """Whole-model inference again, on the graph as it is now: a type it finds for an
        untyped tensor, or a compatible one that knows more (a fold can make a shape
        computable), goes into the type tables. Returns how many types it added or refined.
        The engine calls it after rounds and levels that changed the graph, so a rule sees
        the facts it would see when the result is optimized again."""
        self._found = None
        self._inferred = True
        return self._merge_types(self.inferred_types(), refine=True)

    def _merge_types(self, found: dict[str, onnx.TypeProto], refine: bool) -> int:
        """Put inferred types into every graph's table for the tensors it has: where it has
        none, and with ``refine`` also where the inferred type knows more. Returns how many."""
        changed = 0
        for graph in [self.graph, *self._subgraphs.values()]:
            for name, tp in found.items():
                if not graph.has_tensor(name):
                    continue
                old = graph._types.get(name)
                if old is None or (refine and _refines(old, tp)):
                    graph._types[name] = tp
                    changed += 1
        return changed

    def inferred_types(self) -> dict[str, onnx.TypeProto]:
        """name -> type from ONNX shape inference (with data propagation) on the graph's
        inputs alone: the declared value_info and output shapes are hidden from it, so a
        declaration that lies cannot leak into the result. Computed once per model."""
        if self._found is not None:
            return self._found
        start = time.perf_counter()
        self._found = {}
        proto = self.flush()
        try:
            self._found = infer_types(proto)   # declarations hidden from it
        except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError):
            pass
        finally:
            self.inference_seconds += time.perf_counter() - start
        return self._found

    def has_external_data(self) -> bool:
        return bool(external_tensors(self.proto))

    def external_array(self, tensor: onnx.TensorProto) -> np.ndarray:
        """An external tensor's value, read from the file its load checked and keeps open
        (never opened again by name: see graphopt.modelio.ExternalFiles)."""
        from .modelio import external_files

        return external_files(self).array(tensor)

    def flush(self) -> onnx.ModelProto:
        for graph in list(self._subgraphs.values()) + [self.graph]:
            graph.flush()
        return self.proto

    def to_graphsurgeon(self):
        import onnx_graphsurgeon as gs

        return gs.import_onnx(self.flush())

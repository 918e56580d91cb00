"""Nodes computing the same thing -> one node (common-subexpression elimination), then nodes
whose results nothing reads -> gone (dead-code elimination), as ONNX Runtime's
CommonSubexpressionElimination and its graph resolution do.

Two nodes are the same computation when they have the same op type and domain, the same
attributes (a left-out attribute counts as its schema default: ``Gather(axis=0)`` and
``Gather`` agree) and the same inputs, where two small constants (up to 4096 elements) with
the same element type, shape and bits count as the same input whatever their names, and the
inputs of Add, Mul, And, Or, Xor and Equal in either order. The later node goes and its
readers read the earlier one's outputs; nodes are visited in graph order, so a merge makes
the readers of both nodes the same again and they merge in turn (the shape arithmetic every
layer of an export repeats collapses to one copy).

Never merged: random ops (RandomNormal/Uniform and their Like forms, Multinomial, Bernoulli)
and Dropout, whose every node draws anew; ops with subgraphs (If, Loop, Scan); ops of other
domains than ONNX's and the com.microsoft ops listed below, which are known to compute a
function of their inputs; a node whose output is a graph output or is read by a subgraph by
name when it would be the one to go (the output keeps its name and its producer). Dead-code
elimination removes the same kinds of node (a YieldOp, a custom op may have effects) when
none of their outputs is read or is a graph output, and initializers they alone read.
"""
from __future__ import annotations

import onnx

from graphopt.dsl import Pass
from graphopt.ir import STANDARD_DOMAIN, TYPE_OF_INPUT
from graphopt.vocabulary import MS_DOMAIN, attribute_default, attribute_defaults

MAX_CONSTANT_ELEMENTS = 4096
NONDETERMINISTIC = frozenset({"RandomNormal", "RandomNormalLike", "RandomUniform",
                              "RandomUniformLike", "Multinomial", "Bernoulli", "Dropout"})
# com.microsoft ops that are functions of their inputs (the ones graphopt's rules make)
PURE_CONTRIB = frozenset({"FusedMatMul", *TYPE_OF_INPUT})
COMMUTATIVE = frozenset({"Add", "Mul", "And", "Or", "Xor", "Equal"})


def _pure(graph, node_id: int) -> bool:
    domain, op_type = graph.op_key(node_id)
    if domain == STANDARD_DOMAIN:
        return op_type not in NONDETERMINISTIC and not graph.owns_subgraphs(node_id)
    return domain == MS_DOMAIN and op_type in PURE_CONTRIB


def _is_constant_node(graph, name: str) -> bool:
    producer = graph.producer_of(name)
    return producer is not None and graph.op_key(producer) == (STANDARD_DOMAIN, "Constant")


class _Keys:
    """What identifies a node's computation, with the per-run caches behind it."""

    def __init__(self, graph):
        self.graph = graph
        self.opset = graph.model.opset(STANDARD_DOMAIN) or 1
        self._inputs: dict[str, tuple] = {}
        self._keys: dict[int, tuple] = {}
        self._defaults: dict[str, dict[str, bytes]] = {}

    def rough(self, node_id: int) -> tuple:
        """What two nodes computing the same thing share, read from the indexes only."""
        graph = self.graph
        domain, op_type = graph.op_key(node_id)
        inputs = tuple((0,) if graph.is_initializer(name) or _is_constant_node(graph, name)
                       else (1, name) for name in graph.inputs_of(node_id))
        if domain == STANDARD_DOMAIN and op_type in COMMUTATIVE:
            inputs = tuple(sorted(inputs))
        return domain, op_type, inputs, len(graph.outputs_of(node_id))

    def of(self, node_id: int) -> tuple:
        found = self._keys.get(node_id)
        if found is None:
            found = self._keys[node_id] = self._key(node_id)
        return found

    def _key(self, node_id: int) -> tuple:
        domain, op_type = self.graph.op_key(node_id)
        inputs = tuple(self._input(name) for name in self.graph.inputs_of(node_id))
        if domain == STANDARD_DOMAIN and op_type in COMMUTATIVE:
            inputs = tuple(sorted(inputs))
        outputs = len(self.graph.outputs_of(node_id))
        return domain, op_type, inputs, outputs, self._attributes(node_id, domain, op_type)

    def _input(self, name: str) -> tuple:
        found = self._inputs.get(name)
        if found is None:
            value = self.graph.constant_value(name, MAX_CONSTANT_ELEMENTS) if name else None
            if value is None:
                found = ("tensor", name)
            else:  # the bits, so -0.0 and 0.0 (and NaNs of different payloads) stay apart
                found = ("value", value.dtype.str, value.shape, value.tobytes())
            self._inputs[name] = found
        return found

    def _attributes(self, node_id: int, domain: str, op_type: str) -> tuple:
        node = self.graph.node(node_id)
        found = {a.name: a.SerializeToString() for a in node.attribute}
        for name, serialized in self._default_attributes(domain, op_type).items():
            found.setdefault(name, serialized)
        return tuple(sorted(found.items()))

    def _default_attributes(self, domain: str, op_type: str) -> dict[str, bytes]:
        key = f"{domain}.{op_type}"
        found = self._defaults.get(key)
        if found is None:
            found = {}
            try:
                names = attribute_defaults(op_type, domain)
            except onnx.defs.SchemaError:  # an op the onnx package has no schema for
                names = {}
            for name in names:
                value = attribute_default(op_type, name, domain, self.opset)
                found[name] = onnx.helper.make_attribute(name, value).SerializeToString()
            self._defaults[key] = found
        return found


def _mergeable_into(graph, node_id: int, survivor: int) -> bool:
    """The later node's outputs can all be read off the survivor's instead."""
    for mine, theirs in zip(graph.outputs_of(node_id), graph.outputs_of(survivor),
                            strict=True):
        if not mine:
            continue
        if not theirs or graph.is_output(mine) or graph.read_by_subgraph(mine):
            return False
    return True


def _eliminate_common(graph) -> int:
    keys = _Keys(graph)
    # Nodes are told apart first by what the indexes give cheaply (op, inputs, any constant as
    # one mark): attributes and constant values are read only for a node that shares that
    # with an earlier one, which most nodes of a graph do not.
    alone: dict[tuple, int | None] = {}  # rough key -> its first node, while it is the only one
    first: dict[tuple, int] = {}  # full key -> the first node computing it
    merged = 0
    for node_id in graph.sorted_ids():
        if not graph.has_node(node_id) or not _pure(graph, node_id):
            continue
        rough = keys.rough(node_id)
        if rough not in alone:
            alone[rough] = node_id
            continue
        earlier = alone[rough]
        if earlier is not None:  # the second of its kind: the first one's key is needed now
            alone[rough] = None
            first.setdefault(keys.of(earlier), earlier)
        survivor = first.setdefault(keys.of(node_id), node_id)
        if survivor == node_id or not _mergeable_into(graph, node_id, survivor):
            continue
        inputs, outputs = graph.inputs_of(node_id), graph.outputs_of(node_id)
        graph.remove_node(node_id)
        for mine, theirs in zip(outputs, graph.outputs_of(survivor), strict=True):
            if mine:
                graph.redirect_readers(mine, theirs)
        graph.remove_dead(inputs)
        merged += 1
    return merged


def _eliminate_dead(graph) -> int:
    removed = 0
    for node_id in reversed(graph.sorted_ids()):  # readers first: chains go in one sweep
        if not graph.has_node(node_id) or not _pure(graph, node_id):
            continue
        outputs = graph.outputs_of(node_id)
        if any(name and graph.is_used(name) for name in outputs):
            continue
        inputs = graph.inputs_of(node_id)
        graph.remove_node(node_id)
        for name in inputs:  # an initializer only this node read goes with it
            if name and graph.is_initializer(name) and not graph.is_used(name) \
                    and not graph.is_graph_input(name):
                graph.remove_initializer(name)
        removed += 1
    return removed


def eliminate(graph, report) -> int:
    return _eliminate_common(graph) + _eliminate_dead(graph)


PASS = Pass(
    name="eliminate_common_subexpressions",
    description="Identical computations merged (CSE); nodes nothing reads removed (DCE)",
    level=1,
    tags=("cleanup",),
    run=eliminate,
)

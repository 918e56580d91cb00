"""Plan once, run many: topological order, one kernel per node, last use of every tensor.

A Plan is built for one set of fetched tensor names (graph outputs by default, or any
intermediate) and holds only the nodes those fetches need. Tensors live in integer slots;
each step lists the slots it may release once it has run, so the run keeps no more than
the live set in memory.
"""

from __future__ import annotations

import functools
import heapq
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import onnx
from onnx import AttributeProto, numpy_helper

from graphopt.vocabulary import BACKWARD_PASS_ATTRIBUTE as BACKWARD_ATTR
from graphopt.vocabulary import attribute_default

from .errors import InvalidModelError
from .registry import KernelSpec


def decode_attributes(node: onnx.NodeProto) -> dict[str, Any]:
    attrs: dict[str, Any] = {}
    for attr in node.attribute:
        if attr.type == AttributeProto.STRING:
            attrs[attr.name] = attr.s.decode("utf-8")
        elif attr.type == AttributeProto.STRINGS:
            attrs[attr.name] = [s.decode("utf-8") for s in attr.strings]
        elif attr.type == AttributeProto.TENSOR:
            attrs[attr.name] = numpy_helper.to_array(attr.t)
        elif attr.type in (AttributeProto.INTS, AttributeProto.FLOATS):
            attrs[attr.name] = list(onnx.helper.get_attribute_value(attr))
        else:
            attrs[attr.name] = onnx.helper.get_attribute_value(attr)
    return attrs


@functools.cache  # kernels ask at every run: one schema lookup per (op, attribute, opset)
def _schema_default(op_type: str, name: str, domain: str, opset: int):
    value = attribute_default(op_type, name, domain, opset)
    if isinstance(value, bytes):
        return value.decode("utf-8")
    return tuple(value) if isinstance(value, list) else value


@dataclass(eq=False)
class PlannedNode:
    """A graph node with its attributes decoded once, as kernels see it."""

    index: int  # position in the model's node list
    name: str
    op_type: str
    domain: str
    opset: int
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attrs: dict[str, Any]
    spec: KernelSpec | None = None

    def attr(self, name: str) -> Any:
        """The attribute's value, or the default the op's schema gives at this opset (see
        graphopt.vocabulary.attribute_default; strings decoded as decode_attributes does)."""
        attrs = self.attrs
        if name in attrs:
            return attrs[name]
        value = _schema_default(self.op_type, name, self.domain, self.opset)
        # kept, so the next run reads it as fast as a given attribute
        attrs[name] = value = list(value) if type(value) is tuple else value
        return value

    @property
    def is_backward(self) -> bool:
        return self.attrs.get(BACKWARD_ATTR, 0) == 1

    @property
    def num_outputs(self) -> int:
        return len(self.outputs)

    def label(self) -> str:
        return f"{self.name!r} ({self.domain + '::' if self.domain else ''}{self.op_type})"


@dataclass(eq=False)
class Step:
    node: PlannedNode
    fn: Callable
    in_slots: tuple[int, ...]  # -1 for an omitted optional input
    out_slots: tuple[int, ...]  # -1 for an omitted optional output
    release: tuple[int, ...]  # slots dead once this step has run
    backward: bool
    gemm: bool
    # (input position, slot) of inputs 0 and 1 read last here, once, and made by an earlier
    # node: the session may hand such an array to the kernel to write its result into
    donatable: tuple[tuple[int, int], ...] = ()
    # (keyword, slot): earlier results the kernel takes beyond its inputs (KernelSpec.reads_also)
    also: tuple[tuple[str, int], ...] = ()


@dataclass(eq=False)
class Plan:
    steps: list[Step]
    slot_of: dict[str, int]
    fetches: tuple[str, ...]
    # tensor name -> index of the last step that reads it (-1: read by no planned step)
    last_use: dict[str, int] = field(default_factory=dict)

    @property
    def num_slots(self) -> int:
        return len(self.slot_of)

    @property
    def names_by_slot(self) -> list[str]:
        names = [""] * len(self.slot_of)
        for name, slot in self.slot_of.items():
            names[slot] = name
        return names


def topological_order(nodes: Sequence[PlannedNode], available: Iterable[str]) -> list[PlannedNode]:
    """Kahn's algorithm, ties broken by model order so the result is deterministic."""
    producer: dict[str, PlannedNode] = {}
    for node in nodes:
        for out in node.outputs:
            if out:
                if out in producer:
                    raise InvalidModelError(
                        f"tensor {out!r} is produced by both {producer[out].label()} "
                        f"and {node.label()}"
                    )
                producer[out] = node
    known = set(available)
    waiting_on: dict[int, int] = {}
    consumers: dict[str, list[PlannedNode]] = {}
    undefined = []
    for node in nodes:
        deps = {name for name in node.inputs if name and name not in known}
        for name in deps:
            if name not in producer:
                undefined.append(f"{name!r} (read by {node.label()})")
            consumers.setdefault(name, []).append(node)
        waiting_on[node.index] = len(deps)
    if undefined:
        raise InvalidModelError("undefined input tensor(s): " + ", ".join(undefined))
    ready = [(n.index, n) for n in nodes if waiting_on[n.index] == 0]
    heapq.heapify(ready)
    order: list[PlannedNode] = []
    while ready:
        _, node = heapq.heappop(ready)
        order.append(node)
        for out in node.outputs:
            for consumer in consumers.get(out, ()):
                waiting_on[consumer.index] -= 1
                if waiting_on[consumer.index] == 0:
                    heapq.heappush(ready, (consumer.index, consumer))
    if len(order) != len(nodes):
        stuck = sorted(n.name or n.op_type for n in nodes if waiting_on[n.index] > 0)
        raise InvalidModelError(f"graph has a cycle through: {', '.join(stuck[:10])}")
    return order


def build_plan(
    ordered_nodes: Sequence[PlannedNode], available: Sequence[str], fetches: Sequence[str]
) -> Plan:
    """Plan the nodes needed for ``fetches``; ``ordered_nodes`` is already topological."""
    producer = {out: node for node in ordered_nodes for out in node.outputs if out}
    available_set = set(available)
    unknown = [f for f in fetches if f not in producer and f not in available_set]
    if unknown:
        raise InvalidModelError(f"requested tensor(s) not in the graph: {', '.join(unknown)}")

    needed: set[int] = set()
    stack = [producer[f] for f in fetches if f in producer]
    while stack:
        node = stack.pop()
        if node.index in needed:
            continue
        needed.add(node.index)
        stack.extend(producer[i] for i in node.inputs if i in producer)
    nodes = [n for n in ordered_nodes if n.index in needed]

    slot_of: dict[str, int] = {}
    for name in list(available) + [o for n in nodes for o in n.outputs if o]:
        slot_of.setdefault(name, len(slot_of))

    also = [_reads_also(i, node, nodes) for i, node in enumerate(nodes)]
    last_use: dict[str, int] = {name: -1 for name in slot_of}
    for i, node in enumerate(nodes):
        for name in list(node.inputs) + list(also[i].values()):
            if name:
                last_use[name] = i
    kept = set(fetches)
    release_at: list[list[int]] = [[] for _ in nodes]
    for i, node in enumerate(nodes):
        for out in node.outputs:  # produced but never read: drop at once
            if out and last_use[out] == -1 and out not in kept:
                release_at[i].append(slot_of[out])
    for name, step_index in last_use.items():
        if step_index >= 0 and name not in kept:
            release_at[step_index].append(slot_of[name])

    made_here = {o for n in nodes for o in n.outputs if o}

    def donatable(i: int, node: PlannedNode) -> tuple[tuple[int, int], ...]:
        return tuple(
            (position, slot_of[name]) for position, name in enumerate(node.inputs[:2])
            if name in made_here and name not in kept and last_use[name] == i
            and node.inputs.count(name) == 1)

    steps = [
        Step(
            node=node,
            fn=node.spec.fn,
            in_slots=tuple(slot_of[i] if i else -1 for i in node.inputs),
            out_slots=tuple(slot_of[o] if o else -1 for o in node.outputs),
            release=tuple(release_at[i]),
            backward=node.is_backward,
            gemm=node.spec.gemm,
            donatable=donatable(i, node) if node.spec.inplace else (),
            also=tuple((keyword, slot_of[name]) for keyword, name in also[i].items()),
        )
        for i, node in enumerate(nodes)
    ]
    return Plan(steps=steps, slot_of=slot_of, fetches=tuple(fetches), last_use=last_use)


def _reads_also(i: int, node: PlannedNode, nodes: Sequence[PlannedNode]) -> dict[str, str]:
    """{keyword: tensor} the kernel of ``nodes[i]`` asks for beyond its inputs, each an output
    of one of ``nodes[:i]`` (KernelSpec.reads_also)."""
    chooser = node.spec.reads_also if node.spec is not None else None
    if chooser is None:
        return {}

    def earlier_readers(name: str) -> list[PlannedNode]:
        return [n for n in nodes[:i] if name in n.inputs]

    chosen = dict(chooser(node, earlier_readers))
    made_before = {o for n in nodes[:i] for o in n.outputs if o}
    if not all(name in made_before for name in chosen.values()):
        raise ValueError(f"{node.label()}: reads_also chose a tensor no earlier node makes")
    return chosen

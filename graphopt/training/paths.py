"""Which forward tensors carry a gradient: those computed (through floating-point values)
from a trained tensor and used, directly or not, by the loss. Only their producers need a
gradient definition; everything else (shape arithmetic, masks, unused branches) is skipped.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import onnx

from ..ir import free_variables, subgraphs_of
from .registry import op_label
from .types import TypeTable


@dataclass
class GradientPath:
    nodes: list[onnx.NodeProto]  # forward nodes to differentiate, in forward order
    tensors: set[str]  # tensors that receive a gradient


def node_inputs(node: onnx.NodeProto) -> list[str]:
    """Explicit inputs plus the outer tensors its subgraphs (If/Loop/Scan bodies) read."""
    inputs = [name for name in node.input if name]
    for sub in subgraphs_of(node):
        inputs.extend(free_variables(sub))
    return inputs


def find_gradient_path(graph: onnx.GraphProto, sources: Iterable[str], targets: Iterable[str],
                       types: TypeTable) -> GradientPath:
    reached = set(sources)
    for node in graph.node:  # nodes are in topological order in a valid model
        if any(name in reached for name in node_inputs(node)):
            reached.update(out for out in node.output if out and types.is_float(out))

    _, used_by_loss = _walk_upstream(list(graph.node), targets)
    tensors = reached & used_by_loss
    nodes = [node for node in graph.node if any(out in tensors for out in node.output)]
    return GradientPath(nodes, tensors)


def ancestors(graph_nodes: list[onnx.NodeProto], tensors: Iterable[str]) -> list[onnx.NodeProto]:
    """The nodes ``tensors`` depend on, in their original order."""
    keep, _ = _walk_upstream(graph_nodes, tensors)
    return [node for i, node in enumerate(graph_nodes) if i in keep]


def _walk_upstream(graph_nodes: list[onnx.NodeProto],
                   tensors: Iterable[str]) -> tuple[set[int], set[str]]:
    """(indices of the nodes ``tensors`` depend on, every tensor they depend on)."""
    producer = {out: i for i, node in enumerate(graph_nodes) for out in node.output if out}
    keep: set[int] = set()
    stack = list(tensors)
    seen: set[str] = set()
    while stack:
        tensor = stack.pop()
        if tensor in seen:
            continue
        seen.add(tensor)
        index = producer.get(tensor)
        if index is not None and index not in keep:
            keep.add(index)
            stack.extend(node_inputs(graph_nodes[index]))
    return keep, seen


# ops whose outputs are never floating-point (shapes, indices, booleans): no gradient could
# pass them, so they are not what keeps one from a tensor
_NEVER_FLOAT_OUTPUTS = frozenset({
    "Shape", "Size", "NonZero", "ArgMax", "ArgMin", "IsNaN", "IsInf", "Equal", "Less",
    "LessOrEqual", "Greater", "GreaterOrEqual", "Not", "And", "Or", "Xor"})


def gradient_blocked(graph: onnx.GraphProto, sources: Iterable[str], targets: Iterable[str],
                     has_gradient: Callable[[onnx.NodeProto], bool]) -> dict[str, list[str]]:
    """The ``sources`` that ``targets`` depend on only through nodes without a gradient:
    {source: the op types of those nodes, sorted}. A rotary embedding's ``inv_freq`` reaches
    the logits through Cos and Sin only; a source the targets do not read at all is not
    blocked (its gradient is zero, not missing)."""
    nodes = list(graph.node)
    _, used = _walk_upstream(nodes, targets)
    carrying = set(targets)  # tensors a gradient reaches from the targets
    for node in reversed(nodes):
        if has_gradient(node) and any(out in carrying for out in node.output):
            carrying.update(node_inputs(node))
    blocked = [s for s in dict.fromkeys(sources) if s in used and s not in carrying]
    return {source: sorted({op_label(node) for node in downstream(nodes, [source])
                            if not has_gradient(node)
                            and node.op_type not in _NEVER_FLOAT_OUTPUTS
                            and any(out in used for out in node.output)})
            for source in blocked}


def downstream(graph_nodes: Iterable[onnx.NodeProto], sources: Iterable[str]
               ) -> list[onnx.NodeProto]:
    """The nodes that read ``sources``, directly or through other nodes, in graph order."""
    reached, found = set(sources), []
    for node in graph_nodes:
        if any(name in reached for name in node_inputs(node)):
            reached.update(out for out in node.output if out)
            found.append(node)
    return found

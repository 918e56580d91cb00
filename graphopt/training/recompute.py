"""Activation recomputation: trade a second forward computation for the memory of the
activations a training step keeps for its backward pass.

A training graph keeps every forward tensor a gradient reads alive from the forward pass
until its gradient ran; on a transformer those are each layer's attention scores and
probabilities (batch x heads x seq x seq), its MLP's wide activations and its norms' inputs,
all layers at once. ``torch.utils.checkpoint`` on each transformer block keeps only what
enters the block and computes the rest again when the backward pass reaches it; ONNX
Runtime's memory optimizer does the same as a graph transformation. :func:`recompute_layers`
is that transformation for graphopt's training graphs:

* a forward node's *layer* is the first numbered module on its path: TorchScript's node
  names (``/transformer/h.3/self_attention/MatMul`` -> ``/transformer/h.3``) or the dynamo
  exporter's ``pkg.torch.onnx.name_scopes`` metadata (``transformer.h.3``);
* a layer's *stash* is what its nodes compute for the backward pass alone: a tensor the
  backward reads that no node outside the layer's forward reads and that is no graph output
  (what leaves the layer, the next layer's input, is kept as the checkpoint);
* the nodes that compute the stash from what enters the layer are copied, in their order,
  in front of the backward pass's first reader of the stash; the backward reads the copies,
  so the originals' results die in the forward pass, and one layer's activations at a time
  are alive in the backward pass.

Random ops (Dropout's mask, RandomNormal...) are never computed twice: their results are
kept, so a recomputed layer sees the masks its forward drew. The copies are forward
computations: they carry the forward nodes' attributes (no ``__backwardpass`` mark), so the
FP16 policy gives them the forward's kernels and they compute the forward's values.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field

import onnx

from ..errors import GraphoptError
from ..vocabulary import is_yield_op
from .shared import name_scopes

RECOMPUTE_MODES = ("none", "layers")
SUFFIX = "_recompute"

# ops whose results depend on random draws: computing them twice would draw other values
RANDOM_OPS = frozenset({"Dropout", "RandomNormal", "RandomNormalLike", "RandomUniform",
                        "RandomUniformLike", "Multinomial", "Bernoulli", "BiasDropout",
                        "BitmaskDropout", "BitmaskBiasDropout"})

_NUMBERED = re.compile(r"^[A-Za-z_][\w.]*\.\d+$")   # h.3, layers.12, encoder.layer.0


@dataclass
class Recomputation:
    """What :func:`recompute_layers` did: per layer, the nodes copied into the backward
    pass and the stashed tensors whose memory the forward pass gives back."""
    layers: dict[str, list[str]] = field(default_factory=dict)   # layer -> stashed tensors
    copied_nodes: int = 0

    def describe(self) -> str:
        stashed = sum(len(v) for v in self.layers.values())
        return (f"recompute: {len(self.layers)} layers, {self.copied_nodes} forward nodes "
                f"computed again in the backward pass in place of {stashed} kept tensors")


def layer_of(node: onnx.NodeProto) -> str | None:
    """The first numbered module on ``node``'s path (see the module's words), or None."""
    for scope in (name_scopes(node) or [])[:-1]:   # the last entry is the op's own name
        if _NUMBERED.match(scope):
            return scope
    parts = node.name.split("/")
    for position, part in enumerate(parts[:-1]):
        if _NUMBERED.match(part):
            return "/".join(parts[:position + 1])
    return None


def recompute_layers(model: onnx.ModelProto) -> Recomputation:
    """Rewrite the training graph ``model`` in place so that each layer's stash is computed
    again in the backward pass (see the module's words); returns what was done. A graph
    whose forward nodes name no layer is refused: there is nothing to checkpoint by."""
    graph = model.graph
    nodes = list(graph.node)
    yields = [i for i, n in enumerate(nodes) if is_yield_op(n)]
    if len(yields) != 1:
        raise GraphoptError("recomputation needs a training graph with one YieldOp")
    producer = {out: i for i, n in enumerate(nodes) for out in n.output if out}
    forward = _ancestors(nodes, producer, yields[0])
    layers = {i: layer_of(nodes[i]) for i in forward}
    if not any(layers.values()):
        raise GraphoptError(
            "--recompute layers: no forward node names a numbered module (TorchScript's "
            "'/h.0/' node names or dynamo's name scopes), so the graph has no layers to "
            "recompute by")
    outputs = {o.name for o in graph.output}
    readers: dict[str, list[int]] = {}
    for i, node in enumerate(nodes):
        for name in set(_inputs(node)):
            readers.setdefault(name, []).append(i)
    backward = [i for i in range(len(nodes)) if i not in forward and i != yields[0]]
    backward_set = set(backward)

    stashes: dict[str, list[str]] = {}
    for index in sorted(forward):
        layer = layers[index]
        node = nodes[index]
        if layer is None or node.op_type in RANDOM_OPS:
            continue
        for out in node.output:
            reads = readers.get(out, ())
            if (not out or out in outputs
                    or not any(r in backward_set and r > yields[0] for r in reads)
                    or any(r in forward and layers[r] != layer for r in reads)
                    or any(is_yield_op(nodes[r]) for r in reads)):
                continue
            stashes.setdefault(layer, []).append(out)

    done = Recomputation()
    taken = set(producer) | {v.name for v in graph.input} | {t.name for t in graph.initializer}
    inserts: dict[int, list[onnx.NodeProto]] = {}
    renamed: dict[str, str] = {}
    for layer, stash in stashes.items():
        copies = _closure(nodes, producer, forward, layers, layer, stash)
        names = {}
        for index in copies:
            for out in nodes[index].output:
                if out:
                    names[out] = _fresh(out + SUFFIX, taken)
        first = min((r for t in stash for r in readers[t] if r in backward_set
                     and r > yields[0]), default=None)
        if first is None:
            continue
        clones = []
        for index in copies:
            clone = onnx.NodeProto()
            clone.CopyFrom(nodes[index])
            clone.name = _fresh((clone.name or clone.op_type) + SUFFIX, taken)
            _rename(clone, names)
            clones.append(clone)
        inserts.setdefault(first, []).extend(clones)
        renamed.update({t: names[t] for t in stash})
        done.layers[layer] = stash
        done.copied_nodes += len(clones)
    if not done.layers:
        return done
    for index in backward:
        if index > yields[0]:
            _rename(nodes[index], renamed, outputs_too=False)
    rebuilt = []
    for index, node in enumerate(nodes):
        rebuilt.extend(inserts.get(index, ()))
        rebuilt.append(node)
    del graph.node[:]
    graph.node.extend(rebuilt)
    return done


def _inputs(node: onnx.NodeProto) -> list[str]:
    """``node``'s inputs and the outer tensors its subgraphs read."""
    names = [n for n in node.input if n]
    for attribute in node.attribute:
        bodies = ([attribute.g] if attribute.type == onnx.AttributeProto.GRAPH
                  else list(attribute.graphs))
        for body in bodies:
            names += _outer_reads(body)
    return names


def _outer_reads(body: onnx.GraphProto) -> list[str]:
    local = {i.name for i in body.input} | {t.name for t in body.initializer}
    local |= {o for n in body.node for o in n.output}
    return [name for node in body.node for name in _inputs(node) if name not in local]


def _ancestors(nodes, producer: dict[str, int], start: int) -> set[int]:
    found: set[int] = set()
    stack = [start]
    while stack:
        for name in _inputs(nodes[stack.pop()]):
            index = producer.get(name)
            if index is not None and index not in found:
                found.add(index)
                stack.append(index)
    return found


def _closure(nodes, producer, forward, layers, layer: str, stash: list[str]) -> list[int]:
    """The layer's forward nodes that compute ``stash`` from what enters the layer, in graph
    order; a random op's result is taken as entering."""
    wanted: set[int] = set()
    stack = [producer[t] for t in stash]
    while stack:
        index = stack.pop()
        if index in wanted:
            continue
        wanted.add(index)
        for name in _inputs(nodes[index]):
            source = producer.get(name)
            if (source is not None and source in forward and layers[source] == layer
                    and nodes[source].op_type not in RANDOM_OPS):
                stack.append(source)
    return sorted(wanted)


def _rename(node: onnx.NodeProto, names: dict[str, str], outputs_too: bool = True) -> None:
    for position, name in enumerate(node.input):
        if name in names:
            node.input[position] = names[name]
    if outputs_too:
        for position, name in enumerate(node.output):
            if name in names:
                node.output[position] = names[name]
    for attribute in node.attribute:
        bodies = ([attribute.g] if attribute.type == onnx.AttributeProto.GRAPH
                  else list(attribute.graphs))
        for body in bodies:
            local = {o for n in body.node for o in n.output} | {i.name for i in body.input}
            outer = {k: v for k, v in names.items() if k not in local}
            for inner in body.node:
                _rename(inner, outer, outputs_too=False)


def _fresh(name: str, taken: set[str]) -> str:
    candidate, index = name, 1
    while candidate in taken:
        candidate = f"{name}_{index}"
        index += 1
    taken.add(candidate)
    return candidate

"""A training graph and what it trains, as data: the contract between the graph builder and
whoever runs the graph.

The builder names a gradient output ``<param>_grad`` when it can, but a model may already use
that name (an exporter's ``W_grad`` intermediate makes the output ``W_grad_1``): names are
never read back to learn what is trained. :class:`TrainingGraph` says it, and travels with
the model in its ``metadata_props`` (:data:`METADATA_KEY`, versioned JSON), so a saved
training graph is self-describing. A training graph without that entry (ORTModule's, or one
written before it existed) is described once, here, by :func:`discover`: the ORTModule naming
convention, an initializer ``P`` with a graph output ``P_grad``.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field

import onnx

from ..errors import GraphoptError
from ..ir import nested_nodes
from ..vocabulary import is_yield_op
from .selection import FLOAT_TYPES

METADATA_KEY = "graphopt.training_graph"
METADATA_VERSION = 1


def has_yield(model: onnx.ModelProto) -> bool:
    """Whether the model is a training graph already (a YieldOp in its main graph)."""
    return any(is_yield_op(n) for n in model.graph.node)


@dataclass
class TrainingGraph:
    """A training graph (forward, one YieldOp, gradients) and what it trains.

    ``params``: the trained initializers, in model order; ``grads``: each one's gradient
    output; ``losses``: the YieldOp inputs whose gradient is fed (usually one scalar loss);
    ``loss_grads``: the YieldOp outputs, fed the gradient of each loss (the loss scale);
    ``input_grads``: graph inputs that also get a gradient, and its output; ``frozen``: the
    floating-point initializers that are not trained; ``tied``: the forward model's copies of
    a trained weight, trained as that weight (written back from it); ``buffer_updates``:
    state a step updates without a gradient (BatchNorm's running statistics), buffer ->
    the graph output holding its value after the step, which the next step is fed. Building
    one checks it against the proto and records it in the proto's metadata.
    """
    proto: onnx.ModelProto
    params: list[str]
    grads: dict[str, str]
    losses: list[str]
    loss_grads: list[str]
    input_grads: dict[str, str] = field(default_factory=dict)
    frozen: list[str] = field(default_factory=list)
    # tied copies of trained weights (see .ties): copy -> {"source": name, "transposed": bool};
    # the graph computes each copy from its source, whose gradient sums both uses
    tied: dict[str, dict] = field(default_factory=dict)
    buffer_updates: dict[str, str] = field(default_factory=dict)

    def __post_init__(self):
        problem = _inconsistency(self)
        if problem:
            raise GraphoptError(f"inconsistent training graph: {problem}")
        _write_metadata(self)

    @property
    def data_inputs(self) -> list[str]:
        """Graph inputs that are not initializers: what a step feeds from the data."""
        initializers = {t.name for t in self.proto.graph.initializer}
        return [i.name for i in self.proto.graph.input if i.name not in initializers]

    @classmethod
    def from_model(cls, model: onnx.ModelProto) -> TrainingGraph:
        """The training graph of a model with a YieldOp (the proto is used, not copied, and
        gets the metadata): from its metadata, checked against the graph, or else by
        :func:`discover`."""
        entry = next((p for p in model.metadata_props if p.key == METADATA_KEY), None)
        if entry is None:
            return discover(model)
        return _from_metadata(model, entry.value)

    def with_proto(self, proto: onnx.ModelProto) -> TrainingGraph:
        """The same contract on a rewritten proto (optimized, converted to float16): the
        names it lists must still be there."""
        return TrainingGraph(proto, list(self.params), dict(self.grads), list(self.losses),
                             list(self.loss_grads), dict(self.input_grads), list(self.frozen),
                             dict(self.tied), dict(self.buffer_updates))

    def metadata(self) -> dict:
        return {"version": METADATA_VERSION, "params": self.params, "grads": self.grads,
                "losses": self.losses, "loss_grads": self.loss_grads,
                "input_grads": self.input_grads, "frozen": self.frozen,
                **({"tied": self.tied} if self.tied else {}),
                **({"buffer_updates": self.buffer_updates} if self.buffer_updates else {})}


def discover(model: onnx.ModelProto) -> TrainingGraph:
    """A training graph without graphopt's metadata, read by ORTModule's conventions: an
    initializer ``P`` is trained when a graph output is named ``P_grad``; the losses are the
    YieldOp inputs not listed as ``non_differentiable_outputs``."""
    graph = model.graph
    node = _the_yield(graph)
    if isinstance(node, str):
        raise GraphoptError(node)
    skipped = next((list(a.ints) for a in node.attribute
                    if a.name == "non_differentiable_outputs"), [])
    losses = [x for i, x in enumerate(node.input) if i not in set(skipped)]
    outputs = {o.name for o in graph.output}
    params = [t.name for t in graph.initializer if f"{t.name}_grad" in outputs]
    initializers = {t.name for t in graph.initializer}
    input_grads = {i.name: f"{i.name}_grad" for i in graph.input
                   if i.name not in initializers and f"{i.name}_grad" in outputs}
    return TrainingGraph(model, params, {p: f"{p}_grad" for p in params}, losses,
                         list(node.output), input_grads, frozen_initializers(graph, params))


def frozen_initializers(graph: onnx.GraphProto, params: list[str]) -> list[str]:
    """The floating-point initializers that are not trained."""
    trained = set(params)
    return [t.name for t in graph.initializer
            if t.data_type in FLOAT_TYPES and t.name not in trained]


def _the_yield(graph: onnx.GraphProto) -> onnx.NodeProto | str:
    """The graph's YieldOp, or what is wrong (none, several, one in an If/Loop body)."""
    found = [(n, depth) for n, depth in nested_nodes(graph) if is_yield_op(n)]
    if len(found) != 1 or found[0][1]:
        return (f"the graph has {len(found)} YieldOp node(s)"
                f"{' (one in an If/Loop/Scan body)' if any(d for _, d in found) else ''}; "
                "a training graph has exactly one, in its main graph")
    return found[0][0]


def _inconsistency(tg: TrainingGraph) -> str | None:
    """What in the contract the proto contradicts, in words (None: nothing)."""
    graph = tg.proto.graph
    node = _the_yield(graph)
    if isinstance(node, str):
        return node
    initializers = {t.name for t in graph.initializer}
    inputs = {i.name for i in graph.input}
    outputs = {o.name for o in graph.output}
    checks = [
        (len(set(tg.params)) == len(tg.params), "a trained parameter is listed twice"),
        (set(tg.grads) == set(tg.params), "the gradients listed are not one per trained "
                                          "parameter"),
        (not set(tg.frozen) & set(tg.params), "a tensor is listed both trained and frozen"),
        (len(set(tg.loss_grads)) == len(tg.loss_grads) >= len(tg.losses),
         "the loss gradients are not one per loss"),
    ]
    for ok, words in checks:
        if not ok:
            return words
    for copy, tie in tg.tied.items():
        if tie.get("source") not in tg.params:
            return f"tied copy {copy!r} is not the copy of a trained parameter"
        if copy in initializers or copy in tg.params:
            return f"tied copy {copy!r} is still an initializer of its own"
    for buffer, updated in tg.buffer_updates.items():
        if buffer in tg.params:
            return f"buffer {buffer!r} is also a trained parameter"
        if buffer not in initializers or buffer not in inputs:
            return f"buffer {buffer!r} is not an initializer fed as a graph input"
        if updated not in outputs:
            return f"the update of buffer {buffer!r}, {updated!r}, is not a graph output"
    wanted = [(tg.params, initializers, "trained parameter", "initializer"),
              (tg.frozen, initializers, "frozen tensor", "initializer"),
              (list(tg.grads.values()), outputs, "gradient", "graph output"),
              (list(tg.input_grads), inputs - initializers, "input with a gradient",
               "graph input"),
              (list(tg.input_grads.values()), outputs, "input gradient", "graph output"),
              (tg.losses, set(node.input), "loss", "YieldOp input"),
              (tg.loss_grads, set(node.output), "loss gradient", "YieldOp output")]
    for names, present, what, kind in wanted:
        missing = [n for n in names if n not in present]
        if missing:
            return f"{what} {missing[0]!r} is not a {kind} of the graph"
    grads = list(tg.grads.values()) + list(tg.input_grads.values())
    forward = [g for g in grads if g in set(node.input)]
    if forward:
        return f"gradient {forward[0]!r} is a YieldOp input (a forward output)"
    if len(set(grads)) != len(grads):
        return "two tensors share a gradient output"
    return None


def _write_metadata(tg: TrainingGraph) -> None:
    props = tg.proto.metadata_props
    kept = [p for p in props if p.key != METADATA_KEY]
    del props[:]
    props.extend(kept)
    props.add(key=METADATA_KEY, value=json.dumps(tg.metadata(), separators=(",", ":")))


def _str_list(value) -> bool:
    return isinstance(value, list) and all(isinstance(v, str) for v in value)


def _str_dict(value) -> bool:
    return isinstance(value, dict) and all(isinstance(v, str) for v in value.values())


def _tie_dict(value) -> bool:
    return isinstance(value, dict) and all(
        isinstance(v, dict) and set(v) == {"source", "transposed"}
        and isinstance(v["source"], str) and isinstance(v["transposed"], bool)
        for v in value.values())


_FIELDS = {"params": _str_list, "grads": _str_dict, "losses": _str_list,
           "loss_grads": _str_list, "input_grads": _str_dict, "frozen": _str_list}
_OPTIONAL_FIELDS = {"tied": _tie_dict, "buffer_updates": _str_dict}


def _from_metadata(model: onnx.ModelProto, text: str) -> TrainingGraph:
    where = f"the model's training-graph metadata (metadata_props {METADATA_KEY!r})"
    hint = ("rebuild the training graph from the forward model, or delete that metadata "
            "entry to fall back on '<param>_grad' output names")
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise GraphoptError(f"{where} is not JSON ({exc}); {hint}") from None
    if not isinstance(data, dict):
        raise GraphoptError(f"{where} is not a JSON object; {hint}")
    version = data.get("version")
    if version != METADATA_VERSION:
        raise GraphoptError(f"{where} has version {version!r}; this graphopt reads version "
                            f"{METADATA_VERSION}; {hint}")
    for name, valid in _FIELDS.items():
        if not valid(data.get(name)):
            raise GraphoptError(f"{where}: {name!r} is missing or not a list/map of names; "
                                f"{hint}")
    for name, valid in _OPTIONAL_FIELDS.items():
        if name in data and not valid(data[name]):
            raise GraphoptError(f"{where}: {name!r} is not a map of names; {hint}")
    unknown = sorted(set(data) - set(_FIELDS) - set(_OPTIONAL_FIELDS) - {"version"})
    if unknown:
        raise GraphoptError(f"{where} has unknown field(s) {', '.join(unknown)}; {hint}")
    try:
        return TrainingGraph(model, **{name: data[name] for name in _FIELDS},
                             **{name: data[name] for name in _OPTIONAL_FIELDS if name in data})
    except GraphoptError as exc:
        problem = str(exc).removeprefix("inconsistent training graph: ")
        raise GraphoptError(f"{where} does not match the graph: {problem}; {hint}") from None

"""Forward ONNX model -> ONNX Runtime-style training graph.

Layout of the result, as ORTModule builds it: the forward nodes, one com.microsoft
``YieldOp`` that receives the loss (and any kept outputs) and hands back their gradients,
then the gradient nodes. Graph outputs: the YieldOp's inputs, then the gradient of every
trainable initializer (and of requested graph inputs), named ``<param>_grad`` unless the
model already has a tensor of that name. The result is a :class:`.graph.TrainingGraph`: which
output holds which gradient is stated there (and in the model's metadata), never inferred
from names.

The backward pass walks the forward nodes that carry a gradient in reverse order; each
node's registered definition (``graphopt.training.gradients``) turns its output gradients
into input gradients. A tensor with several consumers gets the Sum of their contributions
once all of them have run, which reverse topological order guarantees.
"""
from __future__ import annotations

import os
from collections import defaultdict

import onnx
from onnx import helper

from ..errors import GraphoptError
from ..ir import MS_DOMAIN, Model, nested_nodes, normalize_domain
from ..modelio import load
from ..vocabulary import YIELD_OP, is_yield_op
from . import gradients  # noqa: F401  (registers the built-in gradient definitions)
from .emitter import Emitter, external_inputs
from .graph import TrainingGraph, frozen_initializers
from .losses import attach_loss
from .paths import GradientPath, ancestors, downstream, find_gradient_path
from .registry import GradientContext, gradient_of, op_label
from .selection import Patterns, as_patterns, listed_names, matching, select_trainable
from .types import TypeTable


def build_training_graph(model: onnx.ModelProto | TrainingGraph | str | os.PathLike,
                         loss: str | None = None, *,
                         outputs: Patterns = None, keep_outputs: Patterns = (),
                         labels_name: str | None = None, trainable: Patterns = None,
                         freeze: Patterns = (), train: Patterns = (), input_grads: Patterns = (),
                         weights_as_inputs: bool = True, class_axis: int | None = None,
                         ignore_index: int | None = None,
                         padding_rows: dict[str, int] | None = None) -> TrainingGraph:
    """Build the training graph of a forward model (a ModelProto, left untouched, or a path):
    a :class:`TrainingGraph`, the proto and what it trains.

    ``loss``: None (the model's scalar output ``outputs`` is the loss), "output" (the
    module outputs go to the YieldOp; their gradients are fed as ``<output>_grad`` and
    default to ones), "cross_entropy" or "mse" (a loss on output ``outputs`` against a new
    graph input ``labels_name``, default "labels"/"target"); see :mod:`.losses`.
    ``keep_outputs``: more graph outputs to keep, without gradient.
    ``trainable``/``freeze``/``train``: names or fnmatch patterns of initializers; all
    floating-point initializers by default, see :mod:`.selection`.
    ``input_grads``: graph inputs (names or patterns) that also get a gradient output.
    ``class_axis``/``ignore_index`` (cross_entropy only): the logits' class axis (default 1,
    negative counts from the end; :func:`.losses.class_axis_for` finds it from the labels'
    shape) and the label value that does not count (an int64); anything else is refused.
    ``weights_as_inputs``: list the trainable initializers as graph inputs too (with their
    values as defaults), as ORTModule does, so a training loop can feed updated weights and
    constant-folding rewrites leave them alone.
    ``padding_rows``: embedding weight -> the row its lookups (Gather on axis 0) never send a
    gradient to, as ``nn.Embedding(padding_idx=row)``; the weight's other uses (a tied
    output projection) still do.

    A model that already has a YieldOp (or a TrainingGraph) is returned as it is, after
    checking it has exactly one, with what it trains read by
    :meth:`TrainingGraph.from_model`. Ops on the path from the trained tensors to the loss
    that have no gradient definition raise one GraphoptError naming all of them.
    """
    if isinstance(model, TrainingGraph):
        model = model.proto
    proto = load(model, check=False).proto  # a copy: the caller's proto is never modified
    # a YieldOp in an If/Loop body counts too (and a training graph has none there)
    yields = [n for n, _ in nested_nodes(proto.graph) if is_yield_op(n)]
    if any(depth for n, depth in nested_nodes(proto.graph) if is_yield_op(n)):
        listed = ", ".join(repr(n.name) for n in yields)
        raise GraphoptError(f"the graph has {len(yields)} YieldOp node(s) ({listed}), one "
                            "inside an If/Loop/Scan body; a training graph has exactly one, "
                            "in its main graph")
    if yields:
        options = {"loss": loss, "outputs": outputs, "keep_outputs": keep_outputs,
                   "labels_name": labels_name, "trainable": trainable, "freeze": freeze,
                   "train": train, "input_grads": input_grads}
        _check_existing_training_graph(yields, [k for k, v in options.items()
                                                if v is not None and v != () and v != []])
        return TrainingGraph.from_model(proto)
    graph = proto.graph
    names = Model(proto).names
    head = attach_loss(proto, loss, outputs, keep_outputs, labels_name, names, class_axis,
                       ignore_index)

    params = select_trainable([(t.name, t.data_type) for t in graph.initializer],
                              trainable, freeze, train)
    frozen = frozen_initializers(graph, params)
    initializer_names = {t.name for t in graph.initializer}
    real_inputs = [i.name for i in graph.input if i.name not in initializer_names]
    wanted_inputs = matching(real_inputs, as_patterns(input_grads), "input_grads")
    differentiated = params + [i for i in real_inputs if i in wanted_inputs]
    # reserve the promised output names before any intermediate can take them
    output_names = {t: names.fresh(f"{t}_grad") for t in differentiated}

    types = TypeTable.infer(proto)
    path = find_gradient_path(graph, differentiated, head.differentiable, types)
    _check_definitions(path, graph, differentiated)

    emitter = Emitter(names, _standard_opset(proto), types)
    yield_outputs = [names.fresh(f"{t}_grad") for t in head.differentiable]
    yield_node = _yield_node(head, yield_outputs, names)
    seeds = dict(zip(head.differentiable, yield_outputs, strict=True))
    grads = _backpropagate(path, seeds, emitter, names, dict(padding_rows or {}))

    emitter.scope = "Grad"
    for tensor, wanted in output_names.items():
        grad = grads.get(tensor) or emitter.zeros_like(tensor)  # a parameter the loss ignores
        emitter.name_output(grad, wanted)

    backward = emitter.live_nodes(list(output_names.values()))
    new_initializers = emitter.live_initializers(backward)
    # Keep the forward nodes the module outputs need (the gradient formulas only read their
    # tensors). Branches of dropped outputs go: they would not be YieldOp ancestors, and
    # the backward-pass marking (YieldOp and every node not its ancestor) would take them
    # for backward nodes.
    reads = external_inputs(backward, new_initializers) - set(yield_outputs)
    forward = ancestors(list(graph.node), head.module_outputs + sorted(reads))
    del graph.node[:]
    graph.node.extend(forward + [yield_node] + backward)
    graph.initializer.extend(new_initializers)
    _drop_stale_value_info(graph)
    _set_outputs(graph, head.module_outputs, output_names, types)
    if weights_as_inputs:
        list_weights_as_inputs(graph, params)
    if not any(normalize_domain(o.domain) == MS_DOMAIN for o in proto.opset_import):
        proto.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    return TrainingGraph(proto, params, {p: output_names[p] for p in params},
                         list(head.differentiable), yield_outputs,
                         {t: output_names[t] for t in differentiated if t not in params}, frozen)


def _check_existing_training_graph(yields: list[onnx.NodeProto], options_given: list[str]):
    if len(yields) > 1:
        listed = ", ".join(repr(n.name) for n in yields)
        raise GraphoptError(f"the graph has {len(yields)} YieldOp nodes ({listed}); a training "
                            "graph has exactly one")
    if options_given:
        raise GraphoptError("the model is already a training graph (it has a YieldOp); "
                            f"{', '.join(options_given)} do(es) not apply to it")


def _standard_opset(proto: onnx.ModelProto) -> int:
    for opset in proto.opset_import:
        if normalize_domain(opset.domain) == "":
            return opset.version
    raise GraphoptError("the model imports no standard ONNX opset")


def _check_definitions(path: GradientPath, graph: onnx.GraphProto, sources: list[str]) -> None:
    missing: dict[str, list[str]] = defaultdict(list)
    for node in path.nodes:
        if gradient_of(node) is None:
            missing[op_label(node)].append(node.name or "<unnamed>")
    if missing:
        listed = "; ".join(f"{op} (node{'s' if len(nodes) > 1 else ''} "
                           f"{', '.join(map(repr, nodes[:5]))}{', ...' if len(nodes) > 5 else ''})"
                           for op, nodes in sorted(missing.items()))
        behind = _sources_reaching(graph, sources, {n for names in missing.values()
                                                    for n in names})
        raise GraphoptError(
            f"no gradient definition for {len(missing)} op type(s) on the path from "
            f"{listed_names(behind)} to the loss: {listed}. Freeze "
            f"{'it' if len(behind) == 1 else 'them'} (--freeze), or register a definition "
            "with graphopt.training.gradient")


def _sources_reaching(graph: onnx.GraphProto, sources: list[str], node_names: set[str]):
    """The trained tensors from which one of the nodes named ``node_names`` is computed."""
    return [source for source in sources
            if any((node.name or "<unnamed>") in node_names
                   for node in downstream(graph.node, [source]))]


def _yield_node(head, yield_outputs: list[str], names) -> onnx.NodeProto:
    count = len(head.differentiable)
    attrs = {"full_shape_outputs": list(range(count))}
    if head.passthrough:
        attrs["non_differentiable_outputs"] = list(range(count, count + len(head.passthrough)))
    return helper.make_node(YIELD_OP, head.module_outputs, yield_outputs, domain=MS_DOMAIN,
                            name=names.fresh(YIELD_OP), **attrs)


def _backpropagate(path: GradientPath, seeds: dict[str, str], emitter: Emitter,
                   names, padding_rows: dict[str, int]) -> dict[str, str]:
    """Run every definition in reverse order; returns the total gradient of each tensor."""
    contributions: dict[str, list[str]] = defaultdict(list)
    for tensor, grad in seeds.items():
        contributions[tensor].append(grad)
    totals: dict[str, str] = {}

    def total(tensor: str) -> str | None:
        if tensor not in totals:
            parts = contributions.get(tensor)
            if not parts:
                return None
            # all consumers have contributed by now: reverse topological order
            totals[tensor] = parts[0] if len(parts) == 1 else emitter.op("Sum", *parts)
        return totals[tensor]

    for node in reversed(path.nodes):
        output_grads = [total(t) if t in path.tensors else None for t in node.output]
        if not any(output_grads):
            continue
        emitter.scope = f"{node.name or node.op_type}_Grad"
        needs = [t in path.tensors for t in node.input]
        ctx = GradientContext(node, output_grads, needs, emitter, names.fresh, padding_rows)
        input_grads = list(gradient_of(node)(ctx))
        # a definition may list fewer entries than inputs (trailing ones get no gradient)
        for tensor, grad in zip(node.input, input_grads, strict=False):
            if grad and tensor in path.tensors:
                contributions[tensor].append(grad)
    emitter.scope = "Grad"
    return {t: g for t in contributions if (g := total(t)) is not None}


def _set_outputs(graph: onnx.GraphProto, module_outputs: list[str], grad_names: dict[str, str],
                 types: TypeTable) -> None:
    """Module outputs keep their declarations (the loss gets its inferred type); a gradient
    is declared like the tensor it is the gradient of."""
    declared = {vi.name: vi for vi in list(graph.input) + list(graph.output)}
    declared.update({t.name: helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
                     for t in graph.initializer})
    del graph.output[:]
    for name in module_outputs:
        graph.output.append(_declaration(name, name, declared, types))
    for tensor, grad in grad_names.items():
        graph.output.append(_declaration(grad, tensor, declared, types))


def _declaration(name: str, like: str, declared: dict, types: TypeTable) -> onnx.ValueInfoProto:
    if like in declared:
        value_info = onnx.ValueInfoProto()
        value_info.CopyFrom(declared[like])
        value_info.name = name
        return value_info
    return helper.make_tensor_value_info(name, types.dtype(like) or onnx.TensorProto.UNDEFINED,
                                         types.shape(like))


def _drop_stale_value_info(graph: onnx.GraphProto) -> None:
    produced = {out for node in graph.node for out in node.output}
    kept = [vi for vi in graph.value_info if vi.name in produced]
    del graph.value_info[:]
    graph.value_info.extend(kept)


def list_weights_as_inputs(graph: onnx.GraphProto, params: list[str]) -> None:
    """Declare the trained initializers as graph inputs too (their values as defaults), as
    ORTModule does: a training loop feeds updated weights, constant folding leaves them."""
    declared = {i.name for i in graph.input}
    by_name = {t.name: t for t in graph.initializer}
    for name in params:
        if name not in declared:
            tensor = by_name[name]
            graph.input.append(helper.make_tensor_value_info(name, tensor.data_type,
                                                             list(tensor.dims)))


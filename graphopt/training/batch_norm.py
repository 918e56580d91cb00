"""BatchNormalization as ``model.train()`` runs it: batch statistics forward, running
statistics updated by every step.

An export made in eval mode (what exporters are usually given) normalises with the running
statistics, which makes the layer a fixed affine map: training it so would train another
model than PyTorch trains. Each such node becomes ONNX Runtime's training op
``com.microsoft.BatchNormInternal`` (inputs as BatchNormalization's; outputs Y, the updated
running mean and variance, and the batch mean and inverse standard deviation its gradient,
``BatchNormalizationGrad``, reads). The updated statistics become graph outputs, listed as
the training graph's ``buffer_updates`` so that a trainer feeds them to the next step and
writes them into the model it saves; a held-out evaluation (inference mode) normalises with
the running statistics, as ``model.eval()`` does.

The running variance takes the *unbiased* batch variance (n / (n - 1)), as PyTorch, cuDNN and
MIOpen do; ONNX's ``training_mode=1`` BatchNormalization takes the biased one. ``momentum``
keeps ONNX's sense (the weight of the old value: PyTorch's 0.1 is exported as 0.9).
"""
from __future__ import annotations

import onnx
from onnx import helper

from ..ir import NameGenerator, graph_names
from ..vocabulary import MS_DOMAIN, STANDARD_DOMAIN, attribute_default, normalize_domain

TRAINING_OP = "BatchNormInternal"


def is_batch_norm(node: onnx.NodeProto) -> bool:
    """The standard BatchNormalization, which training runs as :data:`TRAINING_OP`."""
    return node.op_type == "BatchNormalization" \
        and normalize_domain(node.domain) == STANDARD_DOMAIN


def running_statistics(graph: onnx.GraphProto) -> list[str]:
    """The initializers the main graph's BatchNormalization nodes read as running mean and
    variance: what training updates."""
    initializers = {t.name for t in graph.initializer}
    found = [name for node in graph.node if is_batch_norm(node)
             for name in node.input[3:5] if name in initializers]
    return list(dict.fromkeys(found))


def batch_norms_in_training_mode(model: onnx.ModelProto) -> dict[str, str]:
    """Turn the main graph's BatchNormalization nodes into :data:`TRAINING_OP` nodes, in
    place (importing the com.microsoft domain for them); returns running statistic (an
    initializer) -> the tensor holding its update (:func:`expose_updates` makes those graph
    outputs once the gradients are built, which read the graph's outputs as the loss).
    Statistics that are not initializers (computed in the graph) are normalised by the batch
    too, but have nothing to update."""
    graph = model.graph
    initializers = {t.name for t in graph.initializer}
    fresh = NameGenerator(graph_names(graph)).fresh
    opset = next((o.version for o in model.opset_import
                  if normalize_domain(o.domain) == STANDARD_DOMAIN), None)
    updates: dict[str, str] = {}
    for index, node in enumerate(graph.node):
        if not is_batch_norm(node):
            continue
        given = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        attrs = {name: float(given[name]) if name in given else
                 attribute_default("BatchNormalization", name, STANDARD_DOMAIN, opset)
                 for name in ("epsilon", "momentum")}
        base = node.name or node.output[0]
        outputs = [node.output[0]]
        for position, what in ((3, "running_mean"), (4, "running_var")):
            statistic = node.input[position]
            if statistic in initializers and statistic not in updates:
                updates[statistic] = fresh(f"{statistic}_updated")
                outputs.append(updates[statistic])
            else:   # nothing to write it to (or a second reader): computed, not kept
                outputs.append(fresh(f"{base}_{what}_unused"))
        replacement = helper.make_node(
            TRAINING_OP, list(node.input[:5]), outputs, name=node.name, domain=MS_DOMAIN,
            training_mode=1, **attrs)
        graph.node[index].CopyFrom(replacement)
        if not any(normalize_domain(o.domain) == MS_DOMAIN for o in model.opset_import):
            model.opset_import.append(helper.make_opsetid(MS_DOMAIN, 1))
    return updates


def expose_updates(graph: onnx.GraphProto, updates: dict[str, str]) -> None:
    """Declare each running statistic's update a graph output, typed as the statistic."""
    by_name = {t.name: t for t in graph.initializer}
    for statistic, updated in updates.items():
        tensor = by_name[statistic]
        graph.output.append(helper.make_tensor_value_info(updated, tensor.data_type,
                                                          list(tensor.dims)))

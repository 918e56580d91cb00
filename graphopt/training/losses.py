"""The loss head: what the YieldOp receives, and the loss nodes a named loss appends.

Four ways to say what is trained against:

* ``loss=None``: the model already computes its loss, a scalar graph output (``outputs``
  names it when the model has several outputs);
* ``loss="output"``: ORTModule's way, the module outputs themselves go to the YieldOp and
  their gradients come from outside (fed by the YieldOp output names, default ones);
* ``loss="cross_entropy"``: SoftmaxCrossEntropyLoss (mean) of the logits output against a
  new int64 graph input of class indices (``labels_name``, default "labels");
* ``loss="mse"``: mean of the squared difference between the prediction output and a new
  graph input of the same type and shape (``labels_name``, default "target").

``keep_outputs`` names further graph outputs to keep: they pass through the YieldOp as
non-differentiable outputs (ORT's ``non_differentiable_outputs``), so no gradient flows
from them and the forward nodes that compute them stay on the forward side.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import onnx
from onnx import helper

from ..errors import GraphoptError
from ..ir import NameGenerator
from .selection import Patterns, as_patterns
from .types import FLOAT_TYPES

LOSSES = (None, "output", "cross_entropy", "mse")
DEFAULT_LABELS = {"cross_entropy": "labels", "mse": "target"}


@dataclass
class LossHead:
    differentiable: list[str]  # YieldOp inputs whose gradients the YieldOp hands back
    passthrough: list[str] = field(default_factory=list)  # kept outputs, no gradient

    @property
    def module_outputs(self) -> list[str]:
        return self.differentiable + self.passthrough


def attach_loss(model: onnx.ModelProto, loss: str | None, outputs: Patterns,
                keep_outputs: Patterns, labels_name: str | None,
                names: NameGenerator) -> LossHead:
    """Append the loss nodes (and the labels input) to ``model``; say what YieldOp gets."""
    if loss not in LOSSES:
        raise GraphoptError(f"unknown loss {loss!r}; choose one of {', '.join(map(repr, LOSSES))}")
    graph = model.graph
    declared = {o.name: o for o in graph.output}
    chosen = as_patterns(outputs)
    unknown = [n for n in chosen + as_patterns(keep_outputs) if n not in declared]
    if unknown:
        raise GraphoptError(f"{', '.join(map(repr, unknown))}: not a graph output; the model's "
                            f"outputs are {list(declared)}")
    if loss == "output":
        chosen = chosen or list(declared)
        differentiable = [n for n in chosen if _elem_type(declared[n]) in FLOAT_TYPES | {0}]
        passthrough = [n for n in chosen if n not in differentiable]
    else:
        if len(chosen) > 1 or (not chosen and len(declared) != 1):
            what = "the loss output" if loss is None else "the prediction output"
            raise GraphoptError(f"say which graph output is {what} (outputs=...): the model "
                                f"has {list(declared)}")
        target = chosen[0] if chosen else next(iter(declared))
        if loss is None:
            _check_scalar(declared[target])
            differentiable = [target]
        else:
            opset = next((o.version for o in model.opset_import if o.domain in ("", "ai.onnx")), 0)
            if loss == "cross_entropy" and opset < 12:
                raise GraphoptError(f"loss='cross_entropy' needs opset >= 12 for "
                                    f"SoftmaxCrossEntropyLoss; the model has opset {opset}")
            labels = labels_name or DEFAULT_LABELS[loss]
            if labels in names.used:
                raise GraphoptError(f"labels_name {labels!r} is already a name in the model")
            names.used.add(labels)
            build = _cross_entropy if loss == "cross_entropy" else _mean_squared_error
            differentiable = [build(graph, declared[target], labels, names)]
        passthrough = []
    passthrough += [n for n in as_patterns(keep_outputs) if n not in differentiable + passthrough]
    return LossHead(differentiable, passthrough)


def _elem_type(value_info: onnx.ValueInfoProto) -> int:
    return value_info.type.tensor_type.elem_type


def _check_scalar(output: onnx.ValueInfoProto) -> None:
    tensor_type = output.type.tensor_type
    if not tensor_type.HasField("shape"):
        return
    dims = [d.dim_value if d.HasField("dim_value") else None for d in tensor_type.shape.dim]
    if any(d != 1 for d in dims):
        raise GraphoptError(
            f"output {output.name!r} has shape {dims}, not a scalar loss; use loss='output' to "
            "train against a module output with a gradient fed from outside")


def _shape_without_class_axis(logits: onnx.ValueInfoProto) -> list | None:
    tensor_type = logits.type.tensor_type
    if not tensor_type.HasField("shape"):
        return None
    dims = [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
            for d in tensor_type.shape.dim]
    return dims[:1] + dims[2:]  # SoftmaxCrossEntropyLoss: classes on axis 1


def _cross_entropy(graph: onnx.GraphProto, logits: onnx.ValueInfoProto, labels: str,
                   names: NameGenerator) -> str:
    graph.input.append(helper.make_tensor_value_info(labels, onnx.TensorProto.INT64,
                                                     _shape_without_class_axis(logits)))
    loss = names.fresh("loss")
    graph.node.append(helper.make_node("SoftmaxCrossEntropyLoss", [logits.name, labels], [loss],
                                       name=names.fresh("SoftmaxCrossEntropyLoss"),
                                       reduction="mean"))
    return loss


def _mean_squared_error(graph: onnx.GraphProto, prediction: onnx.ValueInfoProto, target: str,
                        names: NameGenerator) -> str:
    target_info = onnx.ValueInfoProto()
    target_info.CopyFrom(prediction)
    target_info.name = target
    graph.input.append(target_info)
    error, squared, loss = (names.fresh(n) for n in ("mse_error", "mse_squared", "loss"))
    graph.node.extend([
        helper.make_node("Sub", [prediction.name, target], [error], name=names.fresh("mse/Sub")),
        helper.make_node("Mul", [error, error], [squared], name=names.fresh("mse/Mul")),
        # no axes: the mean over every element, in every opset's ReduceMean
        helper.make_node("ReduceMean", [squared], [loss], name=names.fresh("mse/ReduceMean"),
                         keepdims=0),
    ])
    return loss

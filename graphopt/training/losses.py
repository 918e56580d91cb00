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
from ..vocabulary import FLOAT_TYPES, STANDARD_DOMAIN, normalize_domain
from .selection import Patterns, as_patterns

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
                names: NameGenerator, class_axis: int | None = None,
                ignore_index: int | None = None) -> LossHead:
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
        if not differentiable:   # a YieldOp with nothing to differentiate is no training graph
            raise GraphoptError(f"loss='output': none of the outputs {chosen} is a float "
                                "tensor, so there is no gradient to train with")
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
            opset = next((o.version for o in model.opset_import
                          if normalize_domain(o.domain) == STANDARD_DOMAIN), 0)
            if loss == "cross_entropy" and opset < 12:
                raise GraphoptError(f"loss='cross_entropy' needs opset >= 12 for "
                                    f"SoftmaxCrossEntropyLoss; the model has opset {opset}")
            labels = labels_name or DEFAULT_LABELS[loss]
            if labels in names.used:
                raise GraphoptError(f"labels_name {labels!r} is already a name in the model")
            names.used.add(labels)
            if loss == "cross_entropy":
                differentiable = [_cross_entropy(graph, declared[target], labels, names,
                                                 class_axis, ignore_index)]
            else:
                differentiable = [_mean_squared_error(graph, declared[target], labels, names)]
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


def _dims(value: onnx.ValueInfoProto) -> list | None:
    tensor_type = value.type.tensor_type
    if not tensor_type.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
            for d in tensor_type.shape.dim]


def _shape_without_class_axis(logits: onnx.ValueInfoProto, axis: int = 1) -> list | None:
    dims = _dims(logits)
    if dims is None:
        return None
    return dims[:axis] + dims[axis + 1:]  # SoftmaxCrossEntropyLoss: classes on axis 1


def class_axis_for(logits: onnx.ValueInfoProto, labels_shape: tuple[int, ...],
                   labels_name: str = "labels") -> int:
    """The class axis of ``logits`` given the labels' shape (batch axis included): the axis
    whose removal leaves the labels' shape. Axis 1 (ONNX's and PyTorch's layout) wins a
    tie; language models give [batch, seq, vocab] with labels [batch, seq]: the last axis."""
    dims = _dims(logits)
    if dims is None or len(dims) < 2:
        return 1
    labels_shape = tuple(labels_shape)

    def fits(axis: int) -> bool:
        rest = dims[:axis] + dims[axis + 1:]
        return len(rest) == len(labels_shape) and all(
            not isinstance(d, int) or d == n or i == 0   # the batch axis is cut into batches
            for i, (d, n) in enumerate(zip(rest, labels_shape, strict=True)))

    candidates = [axis for axis in range(1, len(dims)) if fits(axis)]
    if candidates:
        return 1 if 1 in candidates else candidates[0]

    def shown(values) -> str:
        return "[" + ", ".join("batch" if i == 0 else str(v if v is not None else "?")
                               for i, v in enumerate(values)) + "]"

    layouts = [f"{shown(dims[:a] + dims[a + 1:])} (classes on axis {a})"
               for a in sorted({1, len(dims) - 1})]
    raise GraphoptError(f"cross_entropy: the logits {logits.name!r} are {shown(dims)} and the "
                        f"labels {labels_name!r} {shown(labels_shape)}; the labels must be the "
                        f"logits' shape without the class axis: {' or '.join(layouts)}")


def _cross_entropy(graph: onnx.GraphProto, logits: onnx.ValueInfoProto, labels: str,
                   names: NameGenerator, class_axis: int | None = None,
                   ignore_index: int | None = None) -> str:
    axis = class_axis or 1
    graph.input.append(helper.make_tensor_value_info(labels, onnx.TensorProto.INT64,
                                                     _shape_without_class_axis(logits, axis)))
    scores = logits.name
    if axis != 1:   # SoftmaxCrossEntropyLoss wants the classes on axis 1: move them there
        rank = len(_dims(logits) or [])
        perm = [0, axis] + [a for a in range(1, rank) if a != axis]
        scores = names.fresh(f"{logits.name}/classes_on_axis_1")
        graph.node.append(helper.make_node("Transpose", [logits.name], [scores], perm=perm,
                                           name=names.fresh("cross_entropy/Transpose")))
    loss = names.fresh("loss")
    extra = {} if ignore_index is None else {"ignore_index": int(ignore_index)}
    graph.node.append(helper.make_node("SoftmaxCrossEntropyLoss", [scores, labels], [loss],
                                       name=names.fresh("SoftmaxCrossEntropyLoss"),
                                       reduction="mean", **extra))
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

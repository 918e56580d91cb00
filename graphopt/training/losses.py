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

import operator
from dataclasses import dataclass, field

import onnx
from onnx import helper

from ..errors import GraphoptError
from ..ir import NameGenerator
from ..vocabulary import FLOAT_TYPES, STANDARD_DOMAIN, normalize_domain
from .selection import Patterns, as_patterns

LOSSES = (None, "output", "cross_entropy", "mse")
DEFAULT_LABELS = {"cross_entropy": "labels", "mse": "target"}
INT64_MIN, INT64_MAX = -2**63, 2**63 - 1   # the labels' type, and the attribute's


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
    given = [n for n, v in (("class_axis", class_axis), ("ignore_index", ignore_index))
             if v is not None]
    if given and loss != "cross_entropy":
        raise GraphoptError(f"{' and '.join(given)} apply only to loss='cross_entropy', not "
                            f"loss={loss!r}")
    ignore_index = checked_ignore_index(ignore_index)
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


def _integer(value, what: str) -> int:
    """``value`` as a Python int (NumPy integers too); bools, floats and strings refused."""
    if isinstance(value, bool):
        raise GraphoptError(f"{what} must be an integer, not {value!r}")
    try:
        return operator.index(value)
    except TypeError:
        raise GraphoptError(f"{what} must be an integer, not {type(value).__name__} "
                            f"{value!r}") from None


def checked_ignore_index(ignore_index) -> int | None:
    """The label value cross_entropy ignores (``--ignore-index``): an integer the int64 labels
    (and SoftmaxCrossEntropyLoss's int64 attribute) can hold."""
    if ignore_index is None:
        return None
    value = _integer(ignore_index, "ignore_index (--ignore-index)")
    if not INT64_MIN <= value <= INT64_MAX:
        raise GraphoptError(f"ignore_index (--ignore-index) {value} is outside int64, the "
                            f"labels' type ({INT64_MIN} to {INT64_MAX}): no label can equal it")
    return value


def checked_class_axis(class_axis, logits: onnx.ValueInfoProto) -> int:
    """An explicit class axis of ``logits`` (``--class-axis``; negative counts from the end),
    as a positive axis; None: axis 1, SoftmaxCrossEntropyLoss's own."""
    if class_axis is None:
        return 1
    axis = _integer(class_axis, "class_axis (--class-axis)")
    dims = _dims(logits)
    if dims is None:
        if axis == 1:
            return 1
        raise GraphoptError(f"class_axis (--class-axis) {axis}: the logits {logits.name!r} "
                            "declare no shape, so the classes can only be on axis 1")
    rank = len(dims)
    positive = axis + rank if axis < 0 else axis
    if not 1 <= positive < rank:
        raise GraphoptError(f"class_axis (--class-axis) {axis} is not a class axis of the "
                            f"logits {logits.name!r} {_shown(dims)}: axis 0 is the batch, "
                            f"the classes are on one of the axes 1 to {rank - 1}")
    return positive


def _shown(values) -> str:
    return "[" + ", ".join("batch" if i == 0 else str(v if v is not None else "?")
                           for i, v in enumerate(values)) + "]"


def class_axis_for(logits: onnx.ValueInfoProto, labels_shape: tuple[int, ...],
                   labels_name: str = "labels", class_axis: int | None = None) -> int:
    """The class axis of ``logits`` given the labels' shape (batch axis included): the axis
    whose removal leaves the labels' shape; language models give [batch, seq, vocab] with
    labels [batch, seq]: the last axis. When several axes qualify (seq == vocab, or dims
    only named) nothing is guessed: one error names them and asks for ``class_axis``. An
    explicit ``class_axis`` is checked against the labels' shape instead."""
    dims = _dims(logits)
    if dims is None or len(dims) < 2:
        return checked_class_axis(class_axis, logits)
    labels_shape = tuple(labels_shape)

    def fits(axis: int) -> bool:
        rest = dims[:axis] + dims[axis + 1:]
        return len(rest) == len(labels_shape) and all(
            not isinstance(d, int) or d == n or i == 0   # the batch axis is cut into batches
            for i, (d, n) in enumerate(zip(rest, labels_shape, strict=True)))

    shown = _shown
    described = (f"the logits {logits.name!r} are {shown(dims)} and the labels "
                 f"{labels_name!r} {shown(labels_shape)}")
    if class_axis is not None:
        axis = checked_class_axis(class_axis, logits)
        if not fits(axis):
            raise GraphoptError(f"cross_entropy: {described}; without the class axis "
                                f"{axis} (--class-axis) the logits are "
                                f"{shown(dims[:axis] + dims[axis + 1:])}, not the labels' shape")
        return axis
    candidates = [axis for axis in range(1, len(dims)) if fits(axis)]
    if len(candidates) == 1:
        return candidates[0]
    if candidates:
        axes = ", ".join(map(str, candidates[:-1])) + f" or {candidates[-1]}"
        choices = " or ".join(f"--class-axis {a}" for a in candidates)
        raise GraphoptError(f"cross_entropy: {described}: the classes could be on axis {axes} "
                            "(removing any of them leaves the labels' shape); say which with "
                            f"{choices} (class_axis= in the Python API)")
    layouts = [f"{shown(dims[:a] + dims[a + 1:])} (classes on axis {a})"
               for a in sorted({1, len(dims) - 1})]
    raise GraphoptError(f"cross_entropy: {described}; the labels must be the "
                        f"logits' shape without the class axis: {' or '.join(layouts)}")


def _cross_entropy(graph: onnx.GraphProto, logits: onnx.ValueInfoProto, labels: str,
                   names: NameGenerator, class_axis: int | None = None,
                   ignore_index: int | None = None) -> str:
    axis = checked_class_axis(class_axis, logits)
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
    extra = {} if ignore_index is None else {"ignore_index": checked_ignore_index(ignore_index)}
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

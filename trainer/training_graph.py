"""Forward model -> the optimized training graph `graphopt run` executes.

Order, as ONNX Runtime training does it:
1. level-1 rewrites on the *forward* graph (ORT's pre-training transformers), trainable
   weights listed as graph inputs so constant folding leaves them alone. The Falcon
   Slice/Gather/Gather on ``fused_qkv`` becomes one Split here, so the gradient builder
   differentiates the Split: its gradient is one Concat instead of a SliceGrad and two
   GatherGrads that each materialise a zero tensor of the full ``fused_qkv`` shape;
2. float16 conversion for ``--precision mixed|fp16`` (loss kept in float32);
3. the training graph (forward, YieldOp, gradients);
4. rewrites up to ``--level`` on the training graph: mark_backward_pass puts
   ``__backwardpass=1`` on the YieldOp and the gradient nodes, the FusedMatMul fusions fuse
   the gradient GEMMs' transposes and scales (the mark is carried over by the engine).

A model that already has a YieldOp skips 1-3.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import numpy_helper

import graphopt
from graphopt.errors import GraphoptError
from graphopt.ir import MS_DOMAIN, normalize_domain
from graphopt.report import Report
from graphopt.training import build_training_graph
from graphopt.training.losses import DEFAULT_LABELS, class_axis_for
from graphopt.training.selection import (
    NOT_TRAINED_REASONS,
    classify_initializers,
    select_trainable,
)

from .precision import to_float16

NAMED_LOSSES = ("cross_entropy", "mse", "output")


@dataclass
class TrainingGraph:
    proto: onnx.ModelProto
    params: list[str]                 # trained initializers, in model order
    grads: dict[str, str]             # param -> graph output holding its gradient
    losses: list[str]                 # YieldOp differentiable inputs (usually one scalar)
    loss_grads: list[str]             # the YieldOp outputs: fed the loss scale
    data_inputs: list[str]            # graph inputs fed from the data
    initial: dict[str, np.ndarray]    # float32 values of the params (from the model)
    reports: list[tuple[str, Report]] = field(default_factory=list)
    fingerprint: str = ""             # what a checkpoint must match to resume (see below)

    @property
    def fired(self) -> list[str]:
        return [name for _, report in self.reports for name in report.fired]


def has_yield(model: onnx.ModelProto) -> bool:
    return any(n.op_type == "YieldOp" and normalize_domain(n.domain) == MS_DOMAIN
               for n in model.graph.node)


def _loss_arguments(loss: str | None, outputs: list[str]) -> dict:
    """``--loss`` -> build_training_graph arguments: a named loss, or an output's name."""
    if loss is None or loss in NAMED_LOSSES:
        return {"loss": loss}
    if loss not in outputs:
        raise GraphoptError(f"--loss {loss!r} is neither {', '.join(NAMED_LOSSES)} nor a graph "
                            f"output; the outputs are {outputs}")
    return {"loss": None, "outputs": [loss]}


def _with_weights_as_inputs(model: onnx.ModelProto, params: list[str]) -> onnx.ModelProto:
    proto = onnx.ModelProto()
    proto.CopyFrom(model)
    declared = {i.name for i in proto.graph.input}
    by_name = {t.name: t for t in proto.graph.initializer}
    for name in params:
        if name not in declared:
            tensor = by_name[name]
            proto.graph.input.append(onnx.helper.make_tensor_value_info(
                name, tensor.data_type, list(tensor.dims)))
    return proto


def build(forward: onnx.ModelProto, *, loss: str | None = None, labels: str | None = None,
          freeze=(), train=(), level: int = 2, precision: str = "fp32",
          disable: tuple[str, ...] = (), label_shapes: dict | None = None,
          ignore_index: int | None = None) -> TrainingGraph:
    """``label_shapes``: the data's array shapes by name, to find the logits' class axis
    for cross_entropy; ``ignore_index``: the label value cross_entropy ignores."""
    reports: list[tuple[str, Report]] = []
    if has_yield(forward):
        if loss is not None or labels or freeze or train:
            raise GraphoptError("the model is already a training graph (it has a YieldOp); "
                                "--loss, --labels, --freeze and --train do not apply")
        training = forward if precision == "fp32" else to_float16(forward, keep_outputs_fp32=False)
    else:
        params = trained_params(forward, freeze, train)
        staged = _with_weights_as_inputs(forward, params)
        staged, report = graphopt.optimize(staged, level=1, disable=list(disable),
                                           check_input=False)
        reports.append(("forward graph, level 1 (before differentiation)", report))
        if precision != "fp32":
            staged = to_float16(staged)
        arguments = _loss_arguments(loss, [o.name for o in forward.graph.output])
        if loss == "cross_entropy":
            arguments.update(_cross_entropy_layout(forward, labels, label_shapes or {}),
                             ignore_index=ignore_index)
        training = build_training_graph(staged, labels_name=labels, train=params,
                                        trainable=params, **arguments)
    training, report = graphopt.optimize(training, level=level, disable=list(disable),
                                         check_input=False)
    reports.append((f"training graph, level {level}", report))
    described = _describe(training, forward, reports)
    described.fingerprint = fingerprint(forward, described.params, loss, labels)
    return described


def fingerprint(forward: onnx.ModelProto, trained, loss: str | None,
                labels: str | None) -> str:
    """SHA-256 of what the training graph computes: the forward model's nodes, inputs,
    outputs, functions and opsets, every initializer's name, type and shape, the values of
    those that are not trained (constants, frozen weights), which weights are trained, and
    the loss. A checkpoint records it so that weights trained in one graph are not resumed
    silently in another with the same weight names and shapes (Relu weights in a Tanh
    model). Left out: the trained weights' values (the checkpoint holds those: the model
    written by -o resumes too), and the rewrites (--level, --disable), which keep the meaning."""
    digest = hashlib.sha256()

    def add(*parts) -> None:
        for part in parts:
            data = part if isinstance(part, bytes) else repr(part).encode()
            digest.update(len(data).to_bytes(8, "little") + data)

    graph = forward.graph
    add(sorted((normalize_domain(o.domain), o.version) for o in forward.opset_import))
    for items in (graph.node, graph.input, graph.output, graph.sparse_initializer,
                  forward.functions):
        add(len(items), *(item.SerializeToString(deterministic=True) for item in items))
    trained = set(trained)
    for tensor in sorted(graph.initializer, key=lambda t: t.name):
        add(tensor.name, tensor.data_type, list(tensor.dims))
        if tensor.name not in trained:
            add(np.ascontiguousarray(numpy_helper.to_array(tensor)).tobytes())
    add(sorted(trained), loss, labels)
    return digest.hexdigest()


def _cross_entropy_layout(forward: onnx.ModelProto, labels: str | None, shapes: dict) -> dict:
    """The class axis of the logits, from the labels the data holds (HF causal LMs give
    [batch, seq, vocab] logits for [batch, seq] labels: the last axis)."""
    name = labels or DEFAULT_LABELS["cross_entropy"]
    outputs = list(forward.graph.output)
    if len(outputs) != 1 or name not in shapes:
        return {}
    return {"class_axis": class_axis_for(outputs[0], tuple(shapes[name]), name)}


def _describe(training: onnx.ModelProto, forward: onnx.ModelProto,
              reports: list[tuple[str, Report]]) -> TrainingGraph:
    graph = training.graph
    yield_node = next(n for n in graph.node
                      if n.op_type == "YieldOp" and normalize_domain(n.domain) == MS_DOMAIN)
    skipped = {a.ints for a in yield_node.attribute if a.name == "non_differentiable_outputs"}
    skipped = set(next(iter(skipped), []))
    losses = [x for i, x in enumerate(yield_node.input) if i not in skipped]
    initializer_names = {t.name for t in graph.initializer}
    outputs = {o.name for o in graph.output}
    params = [t.name for t in graph.initializer if f"{t.name}_grad" in outputs]
    if not params:
        raise GraphoptError("the training graph has no '<param>_grad' output: nothing to train")
    originals = {t.name: t for t in forward.graph.initializer}
    current = {t.name: t for t in graph.initializer}
    initial = {name: numpy_helper.to_array(originals.get(name, current[name])).astype(np.float32)
               for name in params}
    data_inputs = [i.name for i in graph.input if i.name not in initializer_names]
    return TrainingGraph(training, params, {p: f"{p}_grad" for p in params}, losses,
                         list(yield_node.output), data_inputs, initial, reports)


def trained_params(forward: onnx.ModelProto, freeze=(), train=()) -> list[str]:
    """The initializers ``graphopt run`` trains: the parameters (see
    :func:`graphopt.training.selection.classify_initializers`), less ``--freeze``, plus
    ``--train`` (which may name anything floating-point, constants included)."""
    initializers = [(t.name, t.data_type) for t in forward.graph.initializer]
    default, left_out = classify_initializers(forward)
    params = select_trainable(initializers, default, freeze, train)
    if not params:
        kept = [n for key, names in left_out.items() if key != "integer" for n in names]
        hint = (f"; {len(kept)} float initializer(s) are left out by default "
                f"({_names(kept)}): --train PATTERN trains them") if kept else ""
        raise GraphoptError(f"nothing to train: no float initializer is selected{hint}")
    return params


def _names(names: list[str], limit: int = 6) -> str:
    return ", ".join(names[:limit]) + (f", ... ({len(names)})" if len(names) > limit else "")


def _group(name: str) -> str:
    """``h.3.mlp.weight`` -> ``h.*.mlp.weight``: the layers of a stack in one line."""
    return ".".join("*" if part.isdigit() else part for part in name.split("."))


def describe_params(forward: onnx.ModelProto, params: list[str], freeze=(), train=()
                    ) -> list[str]:
    """Lines saying what is trained (count, weights, names grouped by layer) and what is not
    and why; printed before step 1 and by ``--list-params``."""
    sizes = {t.name: int(np.prod(t.dims, dtype=np.int64)) for t in forward.graph.initializer}
    shapes = {t.name: list(t.dims) for t in forward.graph.initializer}
    groups: dict[str, list[str]] = {}
    for name in params:
        groups.setdefault(_group(name), []).append(name)
    total = sum(sizes[n] for n in params)
    lines = [f"trained: {len(params)} tensors, {total:,} weights"]
    rows = []
    for group, names in groups.items():
        dims = {tuple(shapes[n]) for n in names}
        rows.append((group + (f" (x{len(names)})" if len(names) > 1 else ""),
                     str(list(next(iter(dims)))) if len(dims) == 1 else "various shapes",
                     f"{sum(sizes[n] for n in names):,}"))
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines += [f"  {a.ljust(widths[0])}  {b.ljust(widths[1])}  {c.rjust(widths[2])}"
              for a, b, c in rows]
    default, left_out = classify_initializers(forward)
    chosen = set(params)
    frozen = [n for n in default if n not in chosen]
    if frozen:
        left_out = {"frozen": frozen, **left_out}
    reasons = {"frozen": "--freeze", **NOT_TRAINED_REASONS}
    parts = [f"{reasons[key]}: {_names([n for n in names if n not in chosen])}"
             for key, names in left_out.items() if key != "integer"
             and any(n not in chosen for n in names)]
    if parts:
        lines.append("not trained: " + "; ".join(parts) + " (--train PATTERN trains one)")
    return lines

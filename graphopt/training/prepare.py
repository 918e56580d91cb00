"""Forward model -> the optimized training graph a training run executes.

Order, as ONNX Runtime training does it:
1. level-1 rewrites on the *forward* graph (ORT's pre-training transformers), trainable
   weights listed as graph inputs so constant folding leaves them alone. The Falcon
   Slice/Gather/Gather on ``fused_qkv`` becomes one Split here, so the gradient builder
   differentiates the Split: its gradient is one Concat instead of a SliceGrad and two
   GatherGrads that each materialise a zero tensor of the full ``fused_qkv`` shape;
2. float16 conversion for mixed/fp16 training (loss kept in float32; :mod:`.float16`);
3. the training graph (forward, YieldOp, gradients; :mod:`.builder`);
4. rewrites up to ``level`` on the training graph: mark_backward_pass puts
   ``__backwardpass=1`` on the YieldOp and the gradient nodes, the FusedMatMul fusions fuse
   the gradient GEMMs' transposes and scales (the mark is carried over by the engine).

A model that already has a YieldOp skips 1-3; what it trains comes from its metadata, or
from its output names (:meth:`.graph.TrainingGraph.from_model`).
"""
from __future__ import annotations

import dataclasses

import onnx

from ..api import optimize as optimize_model
from ..dsl import BEFORE_DIFFERENTIATION
from ..errors import GraphoptError
from ..ir import Model, external_tensors
from ..modelio import load_external_data, tensor_value
from ..registry import all_rules
from ..report import Report
from .batch_norm import batch_norms_in_training_mode, expose_updates
from .builder import build_training_graph, list_weights_as_inputs
from .float16 import to_float16
from .graph import TrainingGraph, has_yield
from .losses import DEFAULT_LABELS, checked_ignore_index, class_axis_for
from .module_paths import module_paths
from .padding import padding_rows
from .selection import classify_initializers, listed_names, select_trainable
from .ties import Tie, find_ties, tie, tie_entries

NAMED_LOSSES = ("cross_entropy", "mse", "output")


def prepare_training(forward: onnx.ModelProto, *, loss: str | None = None,
                     labels: str | None = None, freeze=(), train=(), level: int = 2,
                     float16: bool = False, disable: tuple[str, ...] = (),
                     label_shapes: dict | None = None, ignore_index: int | None = None,
                     class_axis: int | None = None, external=None, untie: bool = False,
                     padding_idx: int | None = None
                     ) -> tuple[TrainingGraph, list[tuple[str, Report]]]:
    """(the optimized training graph, the rewrite report of each stage with its title).

    ``loss``: a named loss (:data:`NAMED_LOSSES`), an output's name, or None (the model's
    scalar output); ``freeze``/``train``: patterns applied to the default selection
    (:func:`trained_params`); ``float16``: train a float16 copy (mixed or fp16 precision);
    ``label_shapes``: the data's array shapes by name, to find the logits' class axis for
    cross_entropy; ``ignore_index``: the label value cross_entropy ignores; ``class_axis``:
    the logits' class axis, when the labels' shape leaves a choice (seq == vocab).
    ``external``: the open files (:class:`graphopt.modelio.ExternalFiles`) holding the bytes
    of ``forward``'s external tensors (weights a loaded model references where they lie):
    they stay references in the training graph, read where a rule needs a value; a float16
    copy reads them all. Trained weights the exporter wrote twice (a tied output projection
    folded into its transpose, :mod:`.ties`) are trained as one, listed in the graph's
    ``tied``; ``untie`` trains them apart. ``padding_idx``: the embedding row the lookups of
    token ids send no gradient to (:mod:`.padding`; by default the rows a dynamo export
    names). BatchNormalization runs as in ``model.train()``
    (:mod:`.batch_norm`): the running statistics it updates are the graph's
    ``buffer_updates``."""
    def optimize(proto, **options):
        model = Model(proto)   # proto is this function's own copy: no second one
        model.external = external
        return optimize_model(model, **options)

    if float16 and external is not None and external_tensors(forward):
        forward = with_values(forward, external)
    reports: list[tuple[str, Report]] = []
    loss, prediction = split_loss(loss, [o.name for o in forward.graph.output])
    if class_axis is not None and loss != "cross_entropy":
        raise GraphoptError("class_axis (--class-axis) applies only to loss='cross_entropy'")
    if loss == "cross_entropy":   # refused before any rewriting, as the builder would
        ignore_index = checked_ignore_index(ignore_index)
    if has_yield(forward):
        if loss is not None or labels or freeze or train or padding_idx is not None:
            raise GraphoptError("the model is already a training graph (it has a YieldOp); "
                                "--loss, --labels, --freeze, --train and --padding-idx do not "
                                "apply")
        staged = to_float16(forward, keep_outputs_fp32=False) if float16 else forward
        if staged is forward:
            staged = onnx.ModelProto()
            staged.CopyFrom(forward)
        # optimized first, as any model: the engine names a misplaced YieldOp its own way
        optimized, report = optimize(staged, level=level, disable=list(disable))
        reports.append((f"training graph, level {level}", report))
        graph = TrainingGraph.from_model(optimized)
        return _check_trains(graph), reports
    params = trained_params(forward, freeze, train)
    padding = padding_rows(forward, padding_idx)
    staged = onnx.ModelProto()
    staged.CopyFrom(forward)
    params, ties = untied_params(forward, params, untie, external)
    tie(staged, ties)
    buffers = batch_norms_in_training_mode(staged)
    list_weights_as_inputs(staged.graph, params + list(buffers))
    early = differentiable_fusions(level, disable)
    staged, report = optimize(staged, level=1, enable=early, disable=list(disable))
    title = "forward graph, level 1" + (f" and {', '.join(early)}" if early else "")
    reports.append((f"{title} (before differentiation)", report))
    if float16:
        staged = to_float16(staged)
    arguments = _loss_arguments(loss, prediction, [o.name for o in forward.graph.output])
    if loss == "cross_entropy":
        arguments.update(_cross_entropy_layout(forward, labels, label_shapes or {},
                                               class_axis, prediction),
                         ignore_index=ignore_index)
    graph = build_training_graph(staged, labels_name=labels, train=params,
                                 trainable=params, padding_rows=padding, **arguments)
    expose_updates(graph.proto.graph, buffers)
    graph = dataclasses.replace(graph, tied=tie_entries(ties), buffer_updates=buffers)
    optimized, report = optimize(graph.proto, level=level, disable=list(disable))
    reports.append((f"training graph, level {level}", report))
    return _check_trains(graph.with_proto(optimized)), reports


def untied_params(forward: onnx.ModelProto, params: list[str], untie: bool = False,
                  external=None) -> tuple[list[str], list[Tie]]:
    """(``params`` less the tied copies among them, those ties: :mod:`.ties`); ``untie``:
    none are tied."""
    if untie:
        return params, []
    ties = find_ties(forward, params, lambda tensor: tensor_value(tensor, external))
    copies = {t.copy for t in ties}
    return [p for p in params if p not in copies], ties


def with_values(model: onnx.ModelProto, external) -> onnx.ModelProto:
    """A copy of ``model`` holding its external tensors' bytes, read from ``external``."""
    proto = onnx.ModelProto()
    proto.CopyFrom(model)
    loaded = Model(proto)
    loaded.external = external
    load_external_data(loaded)
    return proto


def differentiable_fusions(level: int, disable=()) -> list[str]:
    """The rules above level 1, within ``level``, that the forward graph gets before it is
    differentiated: those tagged BEFORE_DIFFERENTIATION, whose results the gradient builder
    differentiates (Gelu -> GeluGrad). Other level-2 results (FusedMatMul) have no gradient
    here, so the rest of level 2 waits for the training graph. ONNX Runtime's training
    applies its GeluFusion to the forward graph the same way."""
    if level < 2:
        return []
    return [rule.name for rule in all_rules().values()
            if 1 < rule.level <= level and BEFORE_DIFFERENTIATION in rule.tags
            and rule.name not in set(disable)]


def _check_trains(graph: TrainingGraph) -> TrainingGraph:
    if not graph.params:
        raise GraphoptError("nothing to train: the training graph trains no parameter (its "
                            "graphopt metadata lists none, or, without that metadata, no "
                            "initializer P has a 'P_grad' output)")
    return graph


def split_loss(loss: str | None, outputs: list[str]) -> tuple[str | None, str | None]:
    """``--loss`` -> (the loss, the prediction output it reads or None): ``cross_entropy``
    or ``mse`` alone read the model's one output; ``cross_entropy:NAME``/``mse:NAME`` read
    output NAME of a model with several (an HF export's logits beside its ``present.*``)."""
    if loss is None or ":" not in loss or loss in outputs:
        return loss, None
    kind, _, name = loss.partition(":")
    if kind not in ("cross_entropy", "mse"):
        raise GraphoptError(f"--loss {loss!r}: only cross_entropy:OUTPUT and mse:OUTPUT name "
                            "the prediction output; output and an output's name take none")
    if name not in outputs:
        raise GraphoptError(f"--loss {loss!r}: {name!r} is not a graph output; the outputs "
                            f"are {outputs}")
    return kind, name


def _loss_arguments(loss: str | None, prediction: str | None, outputs: list[str]) -> dict:
    """``--loss`` -> build_training_graph arguments: a named loss, or an output's name."""
    if loss == "output" and len(outputs) > 1:
        # the YieldOp would seed every output's gradient with ones: the run would drive the
        # sum of all of them, which is no loss anyone meant
        raise GraphoptError(f"--loss output trains the sum of every output, and the model has "
                            f"{len(outputs)} ({listed_names(outputs)}): name the loss output "
                            "(--loss NAME) or the prediction (--loss cross_entropy:NAME, "
                            "mse:NAME)")
    if loss is None or loss in NAMED_LOSSES:
        return {"loss": loss, **({"outputs": [prediction]} if prediction else {})}
    if loss not in outputs:
        raise GraphoptError(f"--loss {loss!r} is neither {', '.join(NAMED_LOSSES)} nor a graph "
                            f"output; the outputs are {outputs}")
    return {"loss": None, "outputs": [loss]}


def _cross_entropy_layout(forward: onnx.ModelProto, labels: str | None, shapes: dict,
                          class_axis: int | None = None, prediction: str | None = None) -> dict:
    """The class axis of the logits (output ``prediction``, or the model's one output), from
    the labels the data holds (HF causal LMs give [batch, seq, vocab] logits for [batch, seq]
    labels: the last axis), or ``class_axis`` checked against them."""
    name = labels or DEFAULT_LABELS["cross_entropy"]
    outputs = [o for o in forward.graph.output if prediction in (None, o.name)]
    if len(outputs) != 1 or name not in shapes:
        return {} if class_axis is None else {"class_axis": class_axis}
    return {"class_axis": class_axis_for(outputs[0], tuple(shapes[name]), name, class_axis)}


def trained_params(forward: onnx.ModelProto, freeze=(), train=()) -> list[str]:
    """The initializers a run trains: the parameters (see
    :func:`.selection.classify_initializers`), less ``--freeze``, plus ``--train`` (which may
    name anything floating-point, constants included). A pattern matches a weight by its
    name or by the module path an exporter-renamed weight has (:mod:`.module_paths`)."""
    initializers = [(t.name, t.data_type) for t in forward.graph.initializer]
    default, left_out = classify_initializers(forward)
    params = select_trainable(initializers, default, freeze, train, module_paths(forward))
    if not params:
        kept = [n for key, names in left_out.items() if key != "integer" for n in names]
        hint = (f"; {len(kept)} float initializer(s) are left out by default "
                f"({listed_names(kept)}): --train PATTERN trains them") if kept else ""
        raise GraphoptError(f"nothing to train: no float initializer is selected{hint}")
    return params

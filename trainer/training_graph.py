"""The training graph of one ``graphopt run``: graphopt's :class:`TrainingGraph` (built by
:func:`graphopt.training.prepare_training`) plus what the run starts from.

The graph is built by graphopt; this module adds the float32 starting values of the trained
weights (from the forward model: a float16 graph's own initializers are rounded), the
rewrite reports printed before training, and the fingerprint a checkpoint records.
"""
from __future__ import annotations

import dataclasses
import hashlib
from dataclasses import dataclass, field

import numpy as np
import onnx

from graphopt.ir import normalize_domain
from graphopt.modelio import tensor_value
from graphopt.report import Report
from graphopt.training import TrainingGraph
from graphopt.training.batch_norm import running_statistics
from graphopt.training.module_paths import module_paths
from graphopt.training.padding import padding_rows
from graphopt.training.prepare import prepare_training
from graphopt.training.recompute import Recomputation, recompute_layers
from graphopt.training.selection import (
    NOT_TRAINED_REASONS,
    classify_initializers,
    gradient_blockers,
    listed_names,
)


@dataclass(eq=False)   # initial holds arrays
class RunGraph(TrainingGraph):
    """A :class:`TrainingGraph` as a run trains it."""
    # float32 starting values of the trained weights, each an array of its own: a trainer
    # updates them in place (its master weights in fp32 precision: no second copy)
    initial: dict[str, np.ndarray] = field(default_factory=dict)
    # float32 starting values of the running statistics a step updates (buffer_updates)
    buffers: dict[str, np.ndarray] = field(default_factory=dict)
    reports: list[tuple[str, Report]] = field(default_factory=list)
    fingerprint: str = ""             # what a checkpoint must match to resume (see below)
    recomputation: Recomputation | None = None   # --recompute layers: what is computed twice

    @property
    def fired(self) -> list[str]:
        return [name for _, report in self.reports for name in report.fired]


def build(forward: onnx.ModelProto, *, loss: str | None = None, labels: str | None = None,
          freeze=(), train=(), level: int = 2, precision: str = "fp32",
          disable: tuple[str, ...] = (), label_shapes: dict | None = None,
          ignore_index: int | None = None, class_axis: int | None = None,
          external=None, untie: bool = False, recompute: str = "none",
          padding_idx: int | None = None) -> RunGraph:
    """The optimized training graph of ``forward`` for a run in ``precision`` (see
    :func:`graphopt.training.prepare_training` for the other arguments; ``external``: the open
    files holding ``forward``'s external tensors, :class:`graphopt.modelio.ExternalFiles`;
    ``recompute``: "layers" computes each layer's activations again in the backward pass
    instead of keeping them, :mod:`graphopt.training.recompute`)."""
    graph, reports = prepare_training(forward, loss=loss, labels=labels, freeze=freeze,
                                      train=train, level=level, float16=precision != "fp32",
                                      disable=disable, label_shapes=label_shapes,
                                      ignore_index=ignore_index, class_axis=class_axis,
                                      external=external, untie=untie,
                                      padding_idx=padding_idx)
    recomputation = recompute_layers(graph.proto) if recompute == "layers" else None
    originals = {t.name: t for t in forward.graph.initializer}
    current = {t.name: t for t in graph.proto.graph.initializer}
    initial = {name: trainable_copy(tensor_value(originals.get(name, current[name]), external))
               for name in graph.params}
    buffers = {name: trainable_copy(tensor_value(originals.get(name, current[name]), external))
               for name in graph.buffer_updates}
    contract = {f.name: getattr(graph, f.name) for f in dataclasses.fields(TrainingGraph)}
    return RunGraph(**contract, initial=initial, buffers=buffers, reports=reports,
                    fingerprint=fingerprint(forward, graph.params, loss, labels, external),
                    recomputation=recomputation)


def trainable_copy(value: np.ndarray) -> np.ndarray:
    """``value`` as a writable, contiguous float32 array of its own: itself when it is one
    already (read from a file into memory of its own), else a float32 copy (a view of the
    model's bytes, another dtype)."""
    if (value.dtype == np.float32 and value.flags.c_contiguous and value.flags.writeable
            and value.flags.owndata):
        return value
    return np.array(value, dtype=np.float32, order="C")


def fingerprint(forward: onnx.ModelProto, trained, loss: str | None,
                labels: str | None, external=None) -> str:
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
            add(np.ascontiguousarray(tensor_value(tensor, external)).tobytes())
    add(sorted(trained), loss, labels)
    return digest.hexdigest()


def _group(name: str) -> str:
    """``h.3.mlp.weight`` -> ``h.*.mlp.weight``: the layers of a stack in one line."""
    return ".".join("*" if part.isdigit() else part for part in name.split("."))


def with_tied_copies(params: dict[str, np.ndarray], tied: dict[str, dict]
                     ) -> dict[str, np.ndarray]:
    """``params`` and the value of each tied copy, from its trained source (a view)."""
    values = dict(params)
    for copy, tie in tied.items():
        source = params[tie["source"]]
        values[copy] = source.T if tie["transposed"] else source
    return values


def describe_params(forward: onnx.ModelProto, params: list[str], freeze=(), train=(),
                    tied: dict[str, dict] | None = None,
                    padding_idx: int | None = None) -> list[str]:
    """Lines saying what is trained (count, weights, names grouped by layer), which copies
    of a weight are trained as that weight, and what is not trained and why; printed before
    step 1 and by ``--list-params``."""
    sizes = {t.name: int(np.prod(t.dims, dtype=np.int64)) for t in forward.graph.initializer}
    shapes = {t.name: list(t.dims) for t in forward.graph.initializer}
    paths = module_paths(forward)   # exporter-renamed weights, shown by their module path
    groups: dict[str, list[str]] = {}
    for name in params:
        groups.setdefault(_group(paths.get(name, name)), []).append(name)
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
    renamed = [f"{name} = {paths[name]}" for name in params if name in paths]
    if renamed:
        lines.append(f"shown by module path: {listed_names(renamed, 3)} (the exporter's "
                     "names for them, a MatMul's weight stored transposed; --freeze and "
                     "--train take either name)")
    if tied:
        shown = [f"{copy} = {tie['source']}{'^T' if tie['transposed'] else ''}"
                 for copy, tie in tied.items()]
        lines.append(f"tied: {listed_names(shown)} (copies the exporter wrote of a trained "
                     "weight, trained as that weight and written back from it; --untie "
                     "trains them apart)")
    padding = {w: row for w, row in padding_rows(forward, padding_idx).items()
               if w in set(params) | set(tied or ())}
    if padding:
        shown = ", ".join(f"{w} row {row}" for w, row in padding.items())
        how = "--padding-idx" if padding_idx is not None else "as the dynamo export records it"
        lines.append(f"padding rows: {shown} (its lookups send the row no gradient, as "
                     f"nn.Embedding(padding_idx); {how})")
    default, left_out = classify_initializers(forward)
    statistics = running_statistics(forward.graph)
    if statistics:
        lines.append(f"running statistics: {listed_names(statistics)} (BatchNorm as in "
                     "model.train(): each step normalises by its batch and updates these; a "
                     "held-out evaluation and the model -o writes use them)")
    chosen = set(params) | set(tied or ()) | set(statistics)
    frozen = [n for n in default if n not in chosen]
    if frozen:
        left_out = {"frozen": frozen, **left_out}
    reasons = {"frozen": "--freeze", **NOT_TRAINED_REASONS}
    if left_out.get("no_gradient"):
        blockers = gradient_blockers(forward, left_out["no_gradient"])
        ops = sorted({op for found in blockers.values() for op in found})
        reasons["no_gradient"] += (f" (their paths to the outputs cross {', '.join(ops)}, "
                                   "which have no gradient definition)")
    parts = [f"{reasons[key]}: {listed_names([n for n in names if n not in chosen])}"
             for key, names in left_out.items() if key != "integer"
             and any(n not in chosen for n in names)]
    if parts:
        lines.append("not trained: " + "; ".join(parts) + " (--train PATTERN trains one)")
    return lines

"""Which initializers are trained: names or fnmatch patterns, checked against the model.

Default: every floating-point initializer. ``trainable`` narrows that set, ``freeze`` takes
names out of it and ``train`` puts names back (``train`` wins over ``freeze``, so
``freeze=["*"], train=["head.*"]`` fine-tunes the head only). Integer initializers (shapes,
indices, axes) are never trainable. A pattern that matches nothing is an error: it is
almost always a typo, and a silent no-op would train the wrong parameters.
"""
from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping, Sequence

from ..errors import GraphoptError
from ..vocabulary import FLOAT_TYPES
from . import gradients  # noqa: F401  (registers the built-in gradient definitions)
from .batch_norm import is_batch_norm
from .paths import gradient_blocked
from .registry import gradient_of

Patterns = str | Iterable[str] | None


def as_patterns(patterns: Patterns) -> list[str]:
    if patterns is None:
        return []
    if isinstance(patterns, str):
        return [patterns]
    return list(patterns)


def matching(names: Sequence[str], patterns: Sequence[str], option: str,
             aliases: Mapping[str, str] | None = None) -> set[str]:
    """Names matched by any pattern; every pattern must match at least one name. A name's
    alias (its module path, :mod:`.module_paths`) matches for it."""
    aliases = aliases or {}
    found: set[str] = set()
    unmatched = []
    for pattern in patterns:
        if _is_pattern(pattern):
            hits = [n for n in names if fnmatch.fnmatchcase(n, pattern)
                    or (n in aliases and fnmatch.fnmatchcase(aliases[n], pattern))]
        else:
            hits = [n for n in names if pattern in (n, aliases.get(n))]
        if not hits:
            unmatched.append(pattern)
        found.update(hits)
    if unmatched:
        raise GraphoptError(f"{option}: {', '.join(map(repr, unmatched))} match(es) no "
                            f"candidate; candidates are {_preview(names)}")
    return found


def _is_pattern(text: str) -> bool:
    return any(c in text for c in "*?[")


def _preview(names: Sequence[str], limit: int = 12) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return f"[{shown}{', ...' if len(names) > limit else ''}] ({len(names)})"


def select_trainable(initializers: Sequence[tuple[str, int]], trainable: Patterns = None,
                     freeze: Patterns = (), train: Patterns = (),
                     aliases: Mapping[str, str] | None = None) -> list[str]:
    """The trainable initializer names, in model order. ``initializers``: (name, elem_type);
    ``aliases``: name -> the module path a pattern may match it by."""
    all_names = [name for name, _ in initializers]
    float_names = [name for name, elem_type in initializers if elem_type in FLOAT_TYPES]

    def float_only(patterns: list[str], option: str) -> set[str]:
        selected = matching(all_names, patterns, option, aliases)
        named_integers = [n for n in patterns if n in selected and n not in float_names]
        if named_integers:  # asked for by exact name: say why it cannot be
            raise GraphoptError(f"{option}: {', '.join(map(repr, named_integers))} is not "
                                "floating-point; integer initializers are never trainable")
        return selected.intersection(float_names)

    if trainable is None:
        chosen = set(float_names)
    else:
        chosen = float_only(as_patterns(trainable), "trainable")
    chosen -= matching(all_names, as_patterns(freeze), "freeze", aliases)
    chosen |= float_only(as_patterns(train), "train")
    return [name for name in float_names if name in chosen]


# Names exporters give the constants they create (dynamo: val_N / _val_N; TorchScript:
# onnx::Op_N; onnx-graphsurgeon and others: Constant_N). A module's parameters keep their
# module path (``h.0.mlp.weight``), so a name like these is a folded constant, not a weight.
EXPORTER_CONSTANT_NAMES = ("val_*", "_val_*", "onnx::*", "Constant_*")

# (op type, input index) positions that only take shapes, sizes or indices: a float
# initializer read nowhere else (Resize scales, Range bounds, ...) is shape arithmetic.
_SHAPE_ONLY = {"Shape": (0,), "Size": (0,), "ConstantOfShape": (0,), "Reshape": (1,),
               "Expand": (1,), "Tile": (1,), "Slice": (1, 2, 3, 4), "Range": (0, 1, 2),
               "Resize": (1, 2, 3), "Upsample": (1,), "Pad": (1, 3), "Squeeze": (1,),
               "Unsqueeze": (1,), "OneHot": (1,), "TopK": (1,), "EyeLike": (0,)}

NOT_TRAINED_REASONS = {
    "integer": "not floating-point",
    "scalar": "scalars (rank 0)",
    "exporter": "exporter-generated constant names",
    "shape": "read only by shape computations",
    "buffer": "named as PyTorch names module buffers",
    "no_gradient": "no gradient reaches them",
}

# Module buffers (not parameters) that exporters keep as initializers: the rotary embedding's
# inverse frequencies and caches, BatchNorm's running statistics, GPT-2's masked_bias. PyTorch
# never trains them; nor does graphopt by default.
BUFFER_NAMES = ("*inv_freq", "*running_mean", "*running_var", "*_cached", "*masked_bias")


# (op type, input index) of the weight of a linear layer. Exporters fold a transposed weight
# into a new initializer with a generated name (TorchScript: onnx::MatMul_12; dynamo: val_0):
# such a matrix is still the layer's parameter, whatever its name says.
_LAYER_WEIGHTS = {("MatMul", 1), ("MatMul", 0), ("Gemm", 1), ("Gemm", 0), ("Conv", 1),
                  ("ConvTranspose", 1)}
# (op type, input index) of a layer's bias: a BatchNorm the exporter folded into its Conv
# leaves the Conv a new weight and bias (TorchScript: onnx::Conv_27, onnx::Conv_28), both
# trained as the Conv's parameters
_LAYER_BIASES = {("Gemm", 2), ("Conv", 2), ("ConvTranspose", 2)}


def _layer_weights(graph) -> tuple[set[str], set[str]]:
    """(tensors read as the weight of a MatMul, Gemm or Conv, tensors read as the bias of
    a Gemm or Conv)."""
    weights, biases = set(), set()
    for node in graph.node:
        for index, name in enumerate(node.input):
            if (node.op_type, index) in _LAYER_WEIGHTS:
                weights.add(name)
            elif (node.op_type, index) in _LAYER_BIASES:
                biases.add(name)
    return weights, biases


def _shape_only_readers(graph) -> set[str]:
    """Tensors every reader of which (in ``graph``, subgraphs included) takes as a shape."""
    data, shape = set(), set()
    stack = [graph]
    while stack:
        current = stack.pop()
        for node in current.node:
            positions = _SHAPE_ONLY.get(node.op_type, ())
            for index, name in enumerate(node.input):
                (shape if index in positions else data).add(name)
            for attr in node.attribute:
                stack.extend([attr.g] if attr.HasField("g") else [])
                stack.extend(attr.graphs)
    for output in graph.output:
        data.add(output.name)
    return shape - data


def classify_initializers(model) -> tuple[list[str], dict[str, list[str]]]:
    """What ``graphopt run`` trains by default: (parameters in model order, {reason: names
    left out}). A parameter is a floating-point initializer that is not a scalar, not named
    as exporters name their constants (:data:`EXPORTER_CONSTANT_NAMES`; a matrix read as the
    weight of a MatMul, Gemm or Conv, and a Gemm's or Conv's bias, are folded parameters
    whatever their names), not read only
    by shape computations, not named as a module buffer (:data:`BUFFER_NAMES`) and not
    cut off from the outputs' gradient by ops without a gradient definition (see
    :func:`gradient_blockers`), so rotary tables, attention scales and mask constants of an
    exported transformer keep their values, as they do in the PyTorch module."""
    graph = model.graph
    shape_only = _shape_only_readers(graph)
    layer_weights, layer_biases = _layer_weights(graph)
    params: list[str] = []
    left_out: dict[str, list[str]] = {key: [] for key in NOT_TRAINED_REASONS}
    for tensor in graph.initializer:
        name = tensor.name
        if tensor.data_type not in FLOAT_TYPES:
            reason = "integer"
        elif len(tensor.dims) == 0:
            reason = "scalar"
        elif (any(fnmatch.fnmatchcase(name, p) for p in EXPORTER_CONSTANT_NAMES)
              and not (name in layer_weights and len(tensor.dims) >= 2)
              and name not in layer_biases):
            reason = "exporter"
        elif name in shape_only:
            reason = "shape"
        elif any(fnmatch.fnmatchcase(name, p) for p in BUFFER_NAMES):
            reason = "buffer"
        else:
            params.append(name)
            continue
        left_out[reason].append(name)
    blocked = gradient_blockers(model, params)
    left_out["no_gradient"] = list(blocked)
    params = [name for name in params if name not in blocked]
    return params, {k: v for k, v in left_out.items() if v}


def gradient_blockers(model, names: Sequence[str]) -> dict[str, list[str]]:
    """The initializers among ``names`` whose every path to the model's outputs crosses an
    op without a gradient definition: {name: those op types}. A BatchNormalization has one:
    training runs it in training mode (:mod:`.batch_norm`)."""
    graph = model.graph
    return gradient_blocked(graph, names, [o.name for o in graph.output],
                            lambda node: gradient_of(node) is not None or is_batch_norm(node))


def listed_names(names: list[str], limit: int = 6) -> str:
    """The first ``limit`` names, and how many there are if more."""
    return ", ".join(names[:limit]) + (f", ... ({len(names)})" if len(names) > limit else "")

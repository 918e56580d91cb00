"""Output types of the kernels ONNX shape inference does not know (com.microsoft), for the
memory guard.

A type is ``(elem_type, dims)``, each dim an int, a symbol (str) or None (unknown), or None
when nothing is known. ONNX inference skips ops it has no schema for, and every tensor
downstream of one (a FusedMatMul, a gradient op) would then count as zero bytes: each
registered non-ONNX kernel has an estimate here (tests/executor checks it), and the guard
refuses a graph with a kernel that has none rather than count its outputs as free.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import numpy as np
import onnx

from graphopt.tensor_types import fused_matmul_operand_dims
from graphopt.vocabulary import YIELD_OP, attribute_defaults

from .errors import ExecutorError
from .registry import MS_DOMAIN, normalize_domain

Type = tuple[int, list] | None
Estimate = Callable[[Mapping, Sequence[Type], Callable[[int], np.ndarray | None]],
                    list[Type]]

INT64, BOOL = onnx.TensorProto.INT64, onnx.TensorProto.BOOL

ESTIMATES: dict[tuple[str, str], Estimate] = {}


class NoSizeEstimateError(ExecutorError):
    """A kernel whose output sizes the memory guard cannot estimate."""


def estimate(*op_types: str, domain: str = MS_DOMAIN):
    def register(fn: Estimate) -> Estimate:
        for op_type in op_types:
            ESTIMATES[normalize_domain(domain), op_type] = fn
        return fn
    return register


def has_estimate(domain: str, op_type: str) -> bool:
    """Standard ops: ONNX shape inference is the estimate; others need one here."""
    domain = normalize_domain(domain)
    if domain == "":
        return onnx.defs.has(op_type)
    return (domain, op_type) in ESTIMATES


def output_types(node, inputs: Sequence[Type], value: Callable[[int], np.ndarray | None]):
    """Types of a non-ONNX node's outputs; ``value(i)``: input i's value when constant."""
    fn = ESTIMATES.get((normalize_domain(node.domain), node.op_type))
    if fn is None:
        raise NoSizeEstimateError(
            f"the memory guard has no output-size estimate for {node.domain}.{node.op_type} "
            f"(node {node.name!r}); set GRAPHOPT_MEMORY_LIMIT=off to run without the check")
    padded = list(inputs) + [None] * 8
    defaults = {name: value.decode("utf-8") if isinstance(value, bytes) else value
                for name, value in attribute_defaults(node.op_type, node.domain).items()}
    return list(fn({**defaults, **node.attrs}, padded, value))


# ---- helpers ---------------------------------------------------------------------------
def _broadcast(*types: Type) -> Type:
    if not types or any(t is None for t in types):
        return None
    known = list(types)
    rank = max(len(t[1]) for t in known)
    dims = []
    for axis in range(rank):
        column = [t[1][axis - rank + len(t[1])] for t in known if axis - rank + len(t[1]) >= 0]
        ints = [d for d in column if isinstance(d, int) and d != 1]
        if ints:
            dims.append(max(ints))
        elif all(d == 1 for d in column):
            dims.append(1)
        else:
            dims.append(next((d for d in column if d != 1), None))
    return known[0][0], dims


def _like(i: int) -> Estimate:
    return lambda attrs, xs, value: [xs[i]]


def _elem(t: Type, dims) -> Type:
    return None if t is None else (t[0], list(dims))


def _shape_from(value: np.ndarray | None, elem_of: Type) -> Type:
    if elem_of is None:
        return None
    if value is None:
        return None
    return elem_of[0], [int(d) for d in np.asarray(value).reshape(-1)]


# ---- estimates -------------------------------------------------------------------------
estimate("Gelu", "FastGelu", "Scale")(
    lambda attrs, xs, value: [_broadcast(xs[0], xs[1]) if xs[1] is not None else xs[0]])
estimate("BiasGelu")(lambda attrs, xs, value: [_broadcast(xs[0], xs[1])])
estimate("GeluGrad", "FastGeluGrad", "ReluGrad", "BiasGeluGrad_dX", "BiasFastGeluGrad_dX",
         "SoftmaxGrad", "SoftmaxGrad_13", "LogSoftmaxGrad", "LogSoftmaxGrad_13",
         "DropoutGrad")(_like(0))
estimate("SoftmaxCrossEntropyLossGrad", "SoftmaxCrossEntropyLossInternalGrad")(_like(1))


@estimate("FusedMatMul")
def _fused_matmul(attrs, xs, value):
    a, b = xs[0], xs[1]
    if a is None or b is None:
        return [None]

    def operand(dims, trans_batch, trans):  # as the kernel reads it: flags on a vector ignored
        if len(dims) < 2:
            return list(dims)
        return fused_matmul_operand_dims(dims, bool(trans_batch), bool(trans))

    ad = operand(a[1], attrs["transBatchA"], attrs["transA"])
    bd = operand(b[1], attrs["transBatchB"], attrs["transB"])
    if len(ad) == 1 and len(bd) == 1:
        return [(a[0], [])]
    if len(ad) == 1:
        return [(a[0], bd[:-2] + bd[-1:])]
    if len(bd) == 1:
        return [(a[0], ad[:-1])]
    batch = _broadcast((a[0], ad[:-2]), (a[0], bd[:-2]))
    return [(a[0], batch[1] + [ad[-2], bd[-1]])]


@estimate(YIELD_OP)
def _yield(attrs, xs, value):
    skipped = set(attrs.get("non_differentiable_outputs", []))
    return [t for i, t in enumerate(xs) if i not in skipped]


@estimate("InPlaceAccumulatorV2")
def _accumulator(attrs, xs, value):
    return [(BOOL, [1]), xs[0]]


@estimate("LayerNormalizationGrad")
def _layer_norm_grad(attrs, xs, value):
    return [xs[1], xs[2], xs[2]]


@estimate("BatchNormInternal")
def _batch_norm_training(attrs, xs, value):
    return [xs[0]] + [xs[3]] * 4


@estimate("BatchNormalizationGrad")
def _batch_norm_grad(attrs, xs, value):
    return [xs[1], xs[2], xs[2]]


@estimate("ConvGrad")
def _conv_grad(attrs, xs, value):
    dy, w = xs[0], xs[2]
    bias = None if dy is None or w is None else (dy[0], [w[1][0]])
    return [xs[1], w, bias]


@estimate("GatherGrad")
def _gather_grad(attrs, xs, value):
    return [_shape_from(value(0), xs[2])]


@estimate("SliceGrad")
def _slice_grad(attrs, xs, value):
    return [_shape_from(value(1), xs[0])]


@estimate("ConcatTraining")
def _concat_training(attrs, xs, value):
    parts = [t for t in xs if t is not None]
    count = (INT64, [len(parts)])
    if not parts or len({len(t[1]) for t in parts}) != 1:
        return [None, count]
    rank = len(parts[0][1])
    axis = attrs.get("axis", 0) % max(rank, 1)
    lengths = [t[1][axis] for t in parts]
    dims = list(parts[0][1])
    dims[axis] = sum(lengths) if all(isinstance(d, int) for d in lengths) else None
    return [(parts[0][0], dims), count]


@estimate("SplitTraining")
def _split_training(attrs, xs, value):
    x, split = xs[0], value(1)
    if x is None or split is None:
        return [None] * 64
    axis = attrs["axis"] % max(len(x[1]), 1)
    out = []
    for size in np.asarray(split).reshape(-1):
        dims = list(x[1])
        dims[axis] = int(size)
        out.append((x[0], dims))
    return out


@estimate("ReduceSumTraining")
def _reduce_sum_training(attrs, xs, value):
    x, axes = xs[0], value(1)
    if x is None or axes is None:
        return [None]
    rank = len(x[1])
    axes = {int(a) % rank for a in np.asarray(axes).reshape(-1)} if rank else set()
    if not axes:
        if attrs["noop_with_empty_axes"]:
            return [x]
        axes = set(range(rank))
    if attrs["keepdims"]:
        return [(x[0], [1 if i in axes else d for i, d in enumerate(x[1])])]
    return [(x[0], [d for i, d in enumerate(x[1]) if i not in axes])]


@estimate("BroadcastGradientArgs")
def _broadcast_gradient_args(attrs, xs, value):
    ranks = [t[1][0] for t in xs[:2] if t is not None and len(t[1]) == 1]
    rank = max(ranks) if ranks and all(isinstance(r, int) for r in ranks) else None
    return [(INT64, [rank]), (INT64, [rank])]


@estimate("SoftmaxCrossEntropyLossInternal")
def _sce_internal(attrs, xs, value):
    scores, labels = xs[0], xs[1]
    if attrs["reduction"] == "none":
        loss = _elem(scores, labels[1]) if labels is not None else None
    else:
        loss = _elem(scores, [])
    return [loss, scores]


@estimate("ATen", domain="org.pytorch.aten")
def _aten(attrs, xs, value):
    """The ATen operators whose output is as large as their inputs or larger; the rest
    (argmax, max, min and their backward) reduce or scatter into a known input's size."""
    operator = attrs.get("operator")
    if operator == "embedding":
        weight, indices = xs[0], xs[1]
        if weight is None or indices is None:
            return [None]
        return [(weight[0], list(indices[1]) + list(weight[1][1:]))]
    if operator == "embedding_backward":
        grad, rows = xs[0], value(2)
        if grad is None or rows is None:
            return [None]
        return [(grad[0], [int(np.asarray(rows).reshape(()))] + list(grad[1][-1:]))]
    if operator == "numpy_T":
        return [None if xs[0] is None else (xs[0][0], list(reversed(xs[0][1])))]
    if operator == "bitwise_or":
        return [_broadcast(xs[0], xs[1])]
    if operator == "value_selecting_reduction_backward":
        return [None if xs[0] is None else _shape_from(value(3), xs[0])]
    return [None, None]  # argmax/max/min: no larger than their input

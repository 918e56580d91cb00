"""Precision of a training run.

* ``fp32``: everything in float32.
* ``mixed``: FP16 compute, FP32 master weights. The graph is a float16 copy of the model
  (:mod:`graphopt.training.float16`; the loss stays in float32). The loop feeds float16
  copies of the float32 master weights; the gradients come back in float16 and are unscaled
  in float32.
* ``fp16``: the same graph, but the master weights themselves are float16: each update is
  rounded to float16 (small updates vanish; that is the point of comparing it).
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto

from graphopt.errors import GraphoptError

PRECISIONS = ("fp32", "mixed", "fp16")
FLOAT, HALF = TensorProto.FLOAT, TensorProto.FLOAT16


def check_precision(precision: str) -> str:
    if precision not in PRECISIONS:
        raise GraphoptError(f"unknown precision {precision!r}; choose one of "
                            f"{', '.join(PRECISIONS)}")
    return precision


def compute_dtype(precision: str) -> np.dtype:
    return np.dtype(np.float32 if precision == "fp32" else np.float16)


def master_dtype(precision: str) -> np.dtype:
    return np.dtype(np.float16 if precision == "fp16" else np.float32)


def float_weight_elements(model: onnx.ModelProto) -> tuple[int, int]:
    """(float16 elements, float32 elements) of the model's initializers."""
    half = full = 0
    for tensor in model.graph.initializer:
        size = int(np.prod(tensor.dims, dtype=np.int64))
        if tensor.data_type == HALF:
            half += size
        elif tensor.data_type == FLOAT:
            full += size
    return half, full


def default_precision(model: onnx.ModelProto, requested: str | None) -> tuple[str, str | None]:
    """(precision, a note to print or None). Unset: follow the model's dtype (float16
    weights, as an fp16 export or a ``model.half()`` stores them: most of the float weights'
    elements, a few constants may stay float32 -> mixed: FP16 compute as stored, FP32 master
    weights, as PyTorch AMP keeps them).
    ``fp32`` on a float16 model is refused: its graph computes in float16. A model holding
    both float16 and float32 weights is told which way it was taken, and why."""
    half, full = float_weight_elements(model)
    is_half = half > full
    share = (f"{100 * half / (half + full):.1f}% of the model's float weights are float16 "
             f"({half:,} of {half + full:,} elements)") if half and full else None
    if requested is None:
        if is_half:
            return "mixed", ((share or "the model's weights are float16") + ": training with "
                             "--precision mixed (FP16 compute, FP32 master weights; "
                             "--precision fp16 keeps FP16 master weights)")
        if share:
            return "fp32", f"{share}: training with --precision fp32 (--precision mixed " \
                           "computes in FP16)"
        return "fp32", None
    check_precision(requested)
    if requested == "fp32" and is_half:
        raise GraphoptError("--precision fp32: the model's weights are float16; use "
                            "--precision mixed (FP32 master weights) or --precision fp16, "
                            "or leave --precision out")
    return requested, None

"""org.pytorch.aten::ATen: the PyTorch operators ORTModule writes as ATen nodes.

ORTModule's exporter writes some torch operators as one ``ATen`` node whose ``operator``
(and ``overload_name``) attribute names the ATen function, with the function's arguments as
inputs (scalars as constant tensors); its gradient builder writes their gradients the same
way (onnxruntime/training/ortmodule/_custom_op_symbolic_registry.py and
_custom_gradient_registry.py). Every language model meets ``embedding`` (nn.Embedding) and,
in the gradient graph, ``embedding_backward``; the others here are the rest of that
registry that transformer models can reach (argmax, max/min, numpy_T, bitwise_or). The
semantics are ATen's: the gradients are checked against PyTorch in tests/executor.
"""

from __future__ import annotations

import numpy as np

from ..registry import kernel
from ._scatter import scatter_rows
from ._util import norm_axis

ATEN_DOMAIN = "org.pytorch.aten"


def _flag(ctx, value, default=False) -> bool:
    return default if value is None or value.size == 0 else bool(ctx.host_scalar(value))


def _int(ctx, value, default: int) -> int:
    return default if value is None or value.size == 0 else int(ctx.host_scalar(value))


def embedding(ctx, node, weight, indices, padding_idx=None, scale_grad_by_freq=None,
              sparse=None):
    """aten::embedding: rows of ``weight`` (padding_idx and the flags only matter to the
    gradient)."""
    return ctx.xp.take(weight, indices, axis=0)


def embedding_backward(ctx, node, grad, indices, num_weights, padding_idx=None,
                       scale_grad_by_freq=None, sparse=None):
    """aten::embedding_backward: the gradient rows summed into a [num_weights, dim] zero
    tensor; the padding_idx row gets none (-1: no padding row); with scale_grad_by_freq
    each row is divided by how often its index occurs in the batch."""
    xp = ctx.xp
    rows = int(ctx.host_scalar(num_weights))
    flat = indices.reshape(-1)
    grad = grad.reshape(flat.shape[0], -1)
    padding = _int(ctx, padding_idx, -1)
    if _flag(ctx, scale_grad_by_freq):
        counts = xp.bincount(flat, minlength=rows)
        grad = grad / counts[flat].astype(grad.dtype)[:, None]
    result = xp.zeros((rows, grad.shape[1]), dtype=grad.dtype)
    scatter_rows(ctx, result, flat.astype(np.int64), grad, "add")  # NumPy's bits everywhere
    if padding >= 0:
        result[padding] = 0
    return result


def argmax(ctx, node, x, dim=None, keepdim=None):
    """aten::argmax: over the flattened tensor when ``dim`` is omitted (None)."""
    xp = ctx.xp
    if dim is None or dim.size == 0:
        return xp.asarray(xp.argmax(x.reshape(-1)), dtype=np.int64)
    axis = norm_axis(int(ctx.host_scalar(dim)), x.ndim)
    out = xp.argmax(x, axis=axis).astype(np.int64)
    return xp.expand_dims(out, axis) if _flag(ctx, keepdim) else out


def _extreme(ctx, node, x, dim=None, keepdim=None, largest=True):
    xp = ctx.xp
    if node.attrs.get("overload_name", "") != "dim":  # max(input): one scalar
        return (xp.max(x) if largest else xp.min(x)).reshape(())
    axis = norm_axis(int(ctx.host_scalar(dim)), x.ndim)
    # ties: the first index, as ATen's CPU kernel and the gradient definition assume
    indices = (xp.argmax(x, axis=axis) if largest else xp.argmin(x, axis=axis)).astype(np.int64)
    values = xp.take_along_axis(x, xp.expand_dims(indices, axis), axis=axis)
    if not _flag(ctx, keepdim):
        return values.squeeze(axis), indices
    return values, xp.expand_dims(indices, axis)


def value_selecting_reduction_backward(ctx, node, grad, dim, indices, sizes, keepdim):
    """Gradient of max/min(input, dim): each gradient goes to the element that was picked."""
    xp = ctx.xp
    shape = ctx.host_ints(sizes)
    axis = norm_axis(int(ctx.host_scalar(dim)), len(shape))
    if not _flag(ctx, keepdim):
        grad, indices = xp.expand_dims(grad, axis), xp.expand_dims(indices, axis)
    result = xp.zeros(shape, dtype=grad.dtype)
    xp.put_along_axis(result, indices, grad, axis=axis)
    return result


def numpy_t(ctx, node, x):
    return ctx.xp.transpose(x)


def bitwise_or(ctx, node, a, b):
    return ctx.xp.bitwise_or(a, b)


OPERATORS = {
    "embedding": embedding,
    "embedding_backward": embedding_backward,
    "argmax": argmax,
    "max": lambda ctx, node, *args: _extreme(ctx, node, *args, largest=True),
    "min": lambda ctx, node, *args: _extreme(ctx, node, *args, largest=False),
    "value_selecting_reduction_backward": value_selecting_reduction_backward,
    "numpy_T": numpy_t,
    "bitwise_or": bitwise_or,
}


def supports(node) -> bool:
    """Whether the node's ATen operator is one of OPERATORS (checked when a graph is planned,
    so an unsupported one is reported with the others before anything runs)."""
    return node.attrs.get("operator") in OPERATORS


@kernel("ATen", domain=ATEN_DOMAIN)
def aten(ctx, node, *inputs):
    return OPERATORS[node.attrs["operator"]](ctx, node, *inputs)


aten.supports = supports

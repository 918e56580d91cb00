"""com.microsoft activations available in ONNX Runtime's inference build."""

from __future__ import annotations

from ..registry import MS_DOMAIN, kernel
from ._util import bias_gelu_exact, gelu_exact, gelu_tanh, in_compute_dtype

_gelu = in_compute_dtype(gelu_exact)
_fast_gelu = in_compute_dtype(gelu_tanh)


@kernel("Gelu", domain=MS_DOMAIN)
def gelu(ctx, node, x):
    return _gelu(ctx.xp, x)


@kernel("BiasGelu", domain=MS_DOMAIN)
def bias_gelu(ctx, node, x, bias):
    fused = bias_gelu_exact(ctx.xp, x, bias)  # one pass, compiled (NumPy float32)
    return fused if fused is not None else _gelu(ctx.xp, x + bias)


@kernel("FastGelu", domain=MS_DOMAIN)
def fast_gelu(ctx, node, x, bias=None):
    return _fast_gelu(ctx.xp, x if bias is None else x + bias)

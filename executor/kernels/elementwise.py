"""Elementwise math, comparisons, logic, activations, Cast, Where, Clip."""

from __future__ import annotations

import math

import numpy as np

from ..registry import kernel
from ._threads import parts_for, run_blocks, run_split
from ._util import broadcast_shape, erf, gelu_exact, gelu_tanh, in_compute_dtype, np_dtype


def _same_dtype(xp, result, dtype):
    return result if result.dtype == dtype else result.astype(dtype)


# ---- binary arithmetic ---------------------------------------------------------------
def _laid_out_row_major(*operands) -> bool:
    """Whether a ufunc's own result for these operands is surely C-contiguous: numpy follows
    its operands' layout (order="K"), which is row-major when every operand is."""
    return all(x.flags.c_contiguous for x in operands)


def _binary(ctx, ufunc, a, b):
    """``ufunc(a, b)``, written into a donated input of the result's shape and dtype; large
    NumPy results are computed in row blocks on several threads."""
    if a.dtype != b.dtype:
        return ufunc(a, b)
    shape = a.shape if a.shape == b.shape else broadcast_shape(a.shape, b.shape)
    out = ctx.out_for(shape, a.dtype, a, b) if ctx.donated else None
    if out is None and _laid_out_row_major(a, b):
        # a large result: a spare array of its size if one is kept. Only where the result
        # would be row-major anyway: its layout decides the order in which later reductions
        # add, and the bits must not depend on which memory happened to be kept
        out = ctx.large_out(shape, a.dtype)
    rows = shape[0] if shape else 1
    parts = parts_for(math.prod(shape), rows) if ctx.xp is np else 1
    if parts == 1:
        return ufunc(a, b) if out is None else ufunc(a, b, out=out)
    if out is None:
        out = np.empty_like(a) if a.shape == shape else np.empty(shape, a.dtype)
    # operands broadcast along axis 0 (or of lower rank) are read whole by every block
    a_rows = a.ndim == len(shape) and a.shape[0] == rows
    b_rows = b.ndim == len(shape) and b.shape[0] == rows
    run_split(lambda i, j: ufunc(a[i:j] if a_rows else a, b[i:j] if b_rows else b,
                                 out=out[i:j]), rows, parts)
    return out


@kernel("Add", inplace=True)
def add(ctx, node, a, b):
    return _binary(ctx, ctx.xp.add, a, b)


@kernel("Sub", inplace=True)
def sub(ctx, node, a, b):
    return _binary(ctx, ctx.xp.subtract, a, b)


@kernel("Mul", inplace=True)
def mul(ctx, node, a, b):
    return _binary(ctx, ctx.xp.multiply, a, b)


@kernel("Div", inplace=True)
def div(ctx, node, a, b):
    xp = ctx.xp
    if a.dtype.kind in "iu":  # integer division truncates toward zero in ONNX
        return xp.trunc(xp.true_divide(a, b)).astype(a.dtype)
    return _binary(ctx, xp.true_divide, a, b)


@kernel("Pow")
def pow_(ctx, node, a, b):
    xp = ctx.xp
    if a.dtype.kind == "f" and b.dtype.kind == "f" and a.dtype == b.dtype:
        return xp.power(a, b)
    return xp.power(a.astype(np.float64), b.astype(np.float64)).astype(a.dtype)


@kernel("Mod")
def mod(ctx, node, a, b):
    xp = ctx.xp
    if node.attr("fmod") == 1:
        return xp.fmod(a, b)
    return xp.mod(a, b)


@kernel("PRelu")
def prelu(ctx, node, x, slope):
    return ctx.xp.where(x < 0, x * slope, x).astype(x.dtype)


# ---- variadic ------------------------------------------------------------------------
def _fold(fn):
    def run(ctx, node, *xs):
        result = xs[0]
        for x in xs[1:]:
            result = fn(ctx.xp, result, x)
        return result if len(xs) > 1 else result.copy()

    return run


@kernel("Sum", inplace=True)
def sum_(ctx, node, *xs):
    # gradient accumulation: Add's threaded, in-place path for the first pair, then the
    # rest added in the same order into that (fresh or donated) result
    if len(xs) == 1:
        return xs[0].copy()
    result = _binary(ctx, ctx.xp.add, xs[0], xs[1])
    for x in xs[2:]:
        if x.dtype == result.dtype and broadcast_shape(result.shape, x.shape) == result.shape:
            ctx.xp.add(result, x, out=result)
        else:
            result = ctx.xp.add(result, x)
    return result


kernel("Max")(_fold(lambda xp, a, b: xp.maximum(a, b)))
kernel("Min")(_fold(lambda xp, a, b: xp.minimum(a, b)))


@kernel("Mean")
def mean(ctx, node, *xs):
    total = _fold(lambda xp, a, b: xp.add(a, b))(ctx, node, *xs)
    return (total / len(xs)).astype(xs[0].dtype)


# ---- comparisons and logic -----------------------------------------------------------
kernel("Equal")(lambda ctx, node, a, b: ctx.xp.equal(a, b))
kernel("Less")(lambda ctx, node, a, b: ctx.xp.less(a, b))
kernel("LessOrEqual")(lambda ctx, node, a, b: ctx.xp.less_equal(a, b))
kernel("Greater")(lambda ctx, node, a, b: ctx.xp.greater(a, b))
kernel("GreaterOrEqual")(lambda ctx, node, a, b: ctx.xp.greater_equal(a, b))
kernel("And")(lambda ctx, node, a, b: ctx.xp.logical_and(a, b))
kernel("Or")(lambda ctx, node, a, b: ctx.xp.logical_or(a, b))
kernel("Xor")(lambda ctx, node, a, b: ctx.xp.logical_xor(a, b))
kernel("Not")(lambda ctx, node, x: ctx.xp.logical_not(x))
kernel("BitwiseAnd")(lambda ctx, node, a, b: ctx.xp.bitwise_and(a, b))
kernel("BitwiseOr")(lambda ctx, node, a, b: ctx.xp.bitwise_or(a, b))
kernel("BitwiseXor")(lambda ctx, node, a, b: ctx.xp.bitwise_xor(a, b))
kernel("BitwiseNot")(lambda ctx, node, x: ctx.xp.bitwise_not(x))


@kernel("IsNaN")
def isnan(ctx, node, x):
    return ctx.xp.isnan(x)


@kernel("IsInf")
def isinf(ctx, node, x):
    result = ctx.xp.isinf(x)
    if not node.attr("detect_positive"):
        result &= x < 0
    if not node.attr("detect_negative"):
        result &= x > 0
    return result


# ---- unary math ----------------------------------------------------------------------
_UNARY = {
    "Abs": lambda xp, x: xp.abs(x),
    "Neg": lambda xp, x: xp.negative(x),
    "Sign": lambda xp, x: xp.sign(x),
    "Floor": lambda xp, x: xp.floor(x),
    "Ceil": lambda xp, x: xp.ceil(x),
    "Round": lambda xp, x: xp.round(x),  # numpy rounds half to even, as ONNX requires
}
_FLOAT_UNARY = {
    "Sqrt": lambda xp, x: xp.sqrt(x),
    "Exp": lambda xp, x: xp.exp(x),
    "Log": lambda xp, x: xp.log(x),
    "Reciprocal": lambda xp, x: xp.reciprocal(x),
    "Tanh": lambda xp, x: xp.tanh(x),
    "Sin": lambda xp, x: xp.sin(x),
    "Cos": lambda xp, x: xp.cos(x),
    "Tan": lambda xp, x: xp.tan(x),
    "Asin": lambda xp, x: xp.arcsin(x),
    "Acos": lambda xp, x: xp.arccos(x),
    "Atan": lambda xp, x: xp.arctan(x),
    "Sinh": lambda xp, x: xp.sinh(x),
    "Cosh": lambda xp, x: xp.cosh(x),
    "Asinh": lambda xp, x: xp.arcsinh(x),
    "Acosh": lambda xp, x: xp.arccosh(x),
    "Atanh": lambda xp, x: xp.arctanh(x),
    "Erf": lambda xp, x: erf(xp, x),
    "Sigmoid": lambda xp, x: 1.0 / (1.0 + xp.exp(-x)),
    "Softplus": lambda xp, x: xp.logaddexp(0.0, x),
    "Softsign": lambda xp, x: x / (1.0 + xp.abs(x)),
    "Relu": lambda xp, x: xp.maximum(x, 0),
    "Mish": lambda xp, x: x * xp.tanh(xp.logaddexp(0.0, x)),
}


# ops that are one NumPy ufunc pass (or a few in place) on float32/float64: written into a
# donated input, and large ones split in blocks over the cores (the others run as above)
_UFUNC_PASSES = {
    "Abs": (np.abs,), "Neg": (np.negative,), "Sqrt": (np.sqrt,), "Exp": (np.exp,),
    "Log": (np.log,), "Reciprocal": (np.reciprocal,), "Tanh": (np.tanh,), "Sin": (np.sin,),
    "Cos": (np.cos,),
    # 1 / (1 + exp(-x)), the same operations in the same order as the formula above
    "Sigmoid": (np.negative, np.exp, lambda x, out: np.add(x, 1.0, out=out), np.reciprocal),
}
_PASS_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def _in_passes(ctx, passes, x):
    """``passes`` applied in turn (the first reads x, the others work in place), into a
    donated x when there is one; large contiguous arrays in blocks on several threads."""
    out = ctx.out_for(x.shape, x.dtype, x) if ctx.donated else None
    parts = parts_for(x.size, x.size) if x.flags.c_contiguous else 1
    if parts == 1:
        out = passes[0](x, out=out)
        for ufunc in passes[1:]:
            ufunc(out, out=out)
        return out
    if out is None:
        out = np.empty_like(x)
    flat, flat_out = x.reshape(-1), out.reshape(-1)

    def piece(start, stop):
        part = flat_out[start:stop]
        passes[0](flat[start:stop], out=part)
        for ufunc in passes[1:]:
            ufunc(part, out=part)

    # 256K-element blocks: the threads take the GIL once a pass of a block, and with smaller
    # blocks they wait on each other for it (Sigmoid of 4M float32 on 2 cores: 12.7 ms with
    # 32K-element blocks, 10.7 ms with 256K; single-pass ops are the same with either)
    run_blocks(piece, flat.size, 1 << 18)
    return out


def _unary_kernel(fn, float_only, passes=None):
    compute = in_compute_dtype(fn) if float_only else fn

    def run(ctx, node, x):
        if passes is not None and ctx.xp is np and x.dtype in _PASS_DTYPES:
            return _in_passes(ctx, passes, x)
        return _same_dtype(ctx.xp, compute(ctx.xp, x), x.dtype)

    return run


for _name, _fn in _UNARY.items():
    kernel(_name, inplace=_name in _UFUNC_PASSES)(
        _unary_kernel(_fn, False, _UFUNC_PASSES.get(_name)))
for _name, _fn in _FLOAT_UNARY.items():
    kernel(_name, inplace=_name in _UFUNC_PASSES)(
        _unary_kernel(_fn, _name != "Relu", _UFUNC_PASSES.get(_name)))


# ---- parameterised activations -------------------------------------------------------
@kernel("LeakyRelu")
def leaky_relu(ctx, node, x):
    alpha = node.attrs.get("alpha", 0.01)
    return ctx.xp.where(x >= 0, x, x * x.dtype.type(alpha))


@kernel("Elu")
def elu(ctx, node, x):
    alpha = node.attr("alpha")
    return ctx.xp.where(x > 0, x, alpha * (ctx.xp.exp(x) - 1.0)).astype(x.dtype)


@kernel("Celu")
def celu(ctx, node, x):
    alpha = node.attr("alpha")
    xp = ctx.xp
    return (xp.maximum(x, 0) + xp.minimum(0, alpha * (xp.exp(x / alpha) - 1.0))).astype(x.dtype)


@kernel("Selu")
def selu(ctx, node, x):
    alpha = node.attr("alpha")
    gamma = node.attr("gamma")
    xp = ctx.xp
    return (gamma * xp.where(x > 0, x, alpha * (xp.exp(x) - 1.0))).astype(x.dtype)


@kernel("ThresholdedRelu")
def thresholded_relu(ctx, node, x):
    alpha = node.attr("alpha")
    return ctx.xp.where(x > alpha, x, 0).astype(x.dtype)


@kernel("HardSigmoid")
def hard_sigmoid(ctx, node, x):
    alpha, beta = node.attrs.get("alpha", 0.2), node.attrs.get("beta", 0.5)
    return ctx.xp.clip(alpha * x + beta, 0, 1).astype(x.dtype)


@kernel("HardSwish")
def hard_swish(ctx, node, x):
    return (x * ctx.xp.clip(x / 6.0 + 0.5, 0, 1)).astype(x.dtype)


@kernel("Gelu", since=20)
def gelu(ctx, node, x):
    fn = gelu_tanh if node.attr("approximate") == "tanh" else gelu_exact
    return _same_dtype(ctx.xp, in_compute_dtype(fn)(ctx.xp, x), x.dtype)


# ---- Clip, Where, Cast ---------------------------------------------------------------
@kernel("Clip", since=1, until=10)
def clip_attr(ctx, node, x):
    lo = node.attrs.get("min", -math.inf)
    hi = node.attrs.get("max", math.inf)
    return ctx.xp.clip(x, lo, hi).astype(x.dtype)


@kernel("Clip", since=11)
def clip(ctx, node, x, lo=None, hi=None):
    xp = ctx.xp
    result = x
    if lo is not None:
        result = xp.maximum(result, lo)
    if hi is not None:
        result = xp.minimum(result, hi)
    return result.copy() if result is x else result.astype(x.dtype, copy=False)


@kernel("Where")
def where(ctx, node, condition, a, b):
    return ctx.xp.where(condition, a, b)


def _cast(xp, x, dtype):
    if x.dtype == dtype:
        return x.copy()
    if dtype == np.bool_ or x.dtype.kind not in "fV" or dtype.kind == "f" or dtype.kind == "V":
        return x.astype(dtype)
    # float -> integer: C-style truncation of finite values
    return xp.trunc(x).astype(dtype)


@kernel("Cast")
def cast(ctx, node, x):
    return _cast(ctx.xp, x, np_dtype(node.attrs["to"]))


@kernel("CastLike", since=15)
def cast_like(ctx, node, x, like):
    return _cast(ctx.xp, x, like.dtype)

"""Helpers shared by kernel families."""

from __future__ import annotations

import functools
import math

import numpy as np
import onnx

from ._compiled import compiled_kernels
from ._threads import run_blocks, run_rows

_SQRT_HALF = math.sqrt(0.5)


def np_dtype(onnx_elem_type: int) -> np.dtype:
    return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(onnx_elem_type))


def norm_axis(axis: int, rank: int) -> int:
    return axis + rank if axis < 0 else axis


def compute_dtype(dtype) -> np.dtype:
    """Float16/bfloat16 math runs in float32 and is rounded back, as GPU kernels do."""
    dtype = np.dtype(dtype)
    return np.dtype(np.float32) if dtype.itemsize < 4 and dtype.kind in "fV" else dtype


@functools.lru_cache(maxsize=4096)
def broadcast_shape(a: tuple, b: tuple) -> tuple:
    """``np.broadcast_shapes(a, b)``, remembered: a graph meets the same few shape pairs at
    every step, and NumPy's own takes microseconds."""
    return np.broadcast_shapes(a, b)


def row_sums(xp, x2d):
    """Sums of the rows of a 2-D float32/float64 array: einsum's, on NumPy 3-4x faster than
    a reduction along short rows (1024 rows of 64: 16 us against 58 us), and,
    unlike a GEMV's, each row's bits independent of the rows beside it. The same call on
    every backend, so that a GPU computes what NumPy computes."""
    return xp.einsum("ij->i", x2d)


# row_max's transposed path: rows up to _NARROW_ROWS wide, at least _NARROW_MIN_ROWS of them.
# Measured (float32, one core), transposed against NumPy's reduction: 2048 rows of 16: 42 us
# against 136; of 32: 90 against 150; of 48: 138 against 154; of 56: about even; of 64: 80
# against 72. 64 rows of 32: even, 128: 9 us against 13, 32: 7 against 5.6 (the copy's and
# the extra call's fixed cost)
_NARROW_ROWS = 48
_NARROW_MIN_ROWS = 128


def row_max(xp, x2d):
    """Maxima of the rows of a 2-D array. NumPy reduces each row in a loop of its own (~70
    ns a row whatever its width); over narrow rows the elementwise maximum of the rows of
    a transposed copy is 1.6-3x faster (see _NARROW_ROWS). A maximum is exact: the same
    values either way (NaN included, which np.maximum propagates as max does)."""
    rows, width = x2d.shape
    if xp is np and 1 < width <= _NARROW_ROWS and rows >= _NARROW_MIN_ROWS:
        return np.maximum.reduce(np.ascontiguousarray(x2d.T), axis=0)
    return x2d.max(axis=1)


def max_over(xp, x, axes):
    """``x.max(axis=axes, keepdims=True)``. Over one inner axis of a C-contiguous NumPy array
    whose trailing axes are few elements (the class axis of a cross-entropy over (batch,
    classes, positions)), NumPy reduces one short run of elements at a time; halving the
    axis instead (the maximum of its two halves, again and again) works on long runs: (32,
    56, 32): 59-66 us against 84-91; (1, 30000, 16): 0.2 ms against 1.4. With 128 trailing
    elements NumPy's own is 2x faster, so it keeps those. Exact, as row_max."""
    if (xp is not np or len(axes) != 1 or not x.flags.c_contiguous
            or x.size < _HALVED_MIN_SIZE):
        return x.max(axis=axes, keepdims=True)
    axis = axes[0]
    inner = math.prod(x.shape[axis + 1:])
    count = x.shape[axis]
    if not 1 < inner <= _HALVED_MAX_INNER or count < 2:
        return x.max(axis=axes, keepdims=True)
    x3 = x.reshape(-1, count, inner)
    peak = np.empty((x3.shape[0], count // 2, inner), x.dtype)
    count = _halve_into(x3, peak, count)
    while count > 1:  # peak[:, :count] holds the candidates
        count = _halve_into(peak, peak, count)
    return peak[:, :1].reshape(x.shape[:axis] + (1,) + x.shape[axis + 1:])


def _halve_into(source, out, count: int) -> int:
    """out[:, :count // 2] = the maxima of source[:, :count]'s two halves, the odd one out
    folded into the first; returns count // 2."""
    half = count // 2
    np.maximum(source[:, :half], source[:, half:2 * half], out=out[:, :half])
    if count % 2:
        np.maximum(out[:, :1], source[:, count - 1:count], out=out[:, :1])
    return half


_HALVED_MAX_INNER = 32  # max_over halves an axis followed by at most this many elements
_HALVED_MIN_SIZE = 1 << 14  # and of an array this large at least (its calls' fixed cost)


def column_sums(xp, x2d):
    """Sums over the rows of a 2-D float32/float64 array: on NumPy einsum's, the rows added in
    order as NumPy's reduction adds them (the same bits) at 2-4x its speed (1024 rows of 64:
    19 us against 44 us). A BLAS GEMV with ones is faster still when hot, but hands work to
    BLAS threads that a busy machine may not run in time (see blas_threads). From 256
    columns on NumPy's reduction is as fast or faster (1024 columns: 1.3x)."""
    if x2d.shape[1] >= 256:
        return x2d.sum(axis=0)
    return xp.einsum("ij->j", x2d)


def row_dots(xp, a2d, b2d):
    """``row_sums(xp, a2d * b2d)`` without the product's temporary: einsum multiplies and adds
    in one pass (float32, one core: 1024 rows of 64: 23 us against 31; of 256: 68 against
    92)."""
    return xp.einsum("ij,ij->i", a2d, b2d)


def column_dots(xp, a2d, b2d):
    """``column_sums(xp, a2d * b2d)`` without the product's temporary, by einsum at every
    width (float32, one core: 1024 rows of 64: 25 us against 34; of 256: 65 against 116;
    2048 rows of 1024: 0.67 ms against 1.23)."""
    return xp.einsum("ij,ij->j", a2d, b2d)


def sums_over(xp, x, axes):
    """``x.sum(axis=axes, keepdims=True)``; over one axis of a float32/float64 array by einsum,
    as row_sums (each sum's bits independent of the others, the same call on every backend)."""
    if len(axes) != 1 or not summed_by_rows(x.dtype) or not x.size or x.ndim > 26:
        return x.sum(axis=axes, keepdims=True)
    letters = "abcdefghijklmnopqrstuvwxyz"[:x.ndim]
    kept = letters[:axes[0]] + letters[axes[0] + 1:]
    return xp.expand_dims(xp.einsum(f"{letters}->{kept}", x), axes[0])


def summed_by_rows(dtype) -> bool:
    """Whether the row kernels' (rows, D) paths apply: float32/float64 (half precision is
    computed in float32 before)."""
    return dtype in (np.float32, np.float64)


# float32 erf, faster than the float64 formula:
# erf(x) ~= x * P(x^2) / Q(x^2) on |x| <= _ERF32_CLAMP, Q monic,
# coefficients lowest degree first, fitted by scripts/fit_erf32.py (which prints these); beyond
# the clamp erf(x) rounds to +-1 in float32 (erfc(3.92) = 2.96e-8 < 2**-25). The fit is within
# 3.4e-8 (relative); evaluated in float32, over every float32 (scripts/fit_erf32.py
# --exhaustive), the largest error is 4.36e-7 absolute and, for |erf(x)| >= 2**-126, 4.36e-7
# relative (at x = 3.2803822; tests/executor/test_erf_float32.py pins it), subnormal results
# within 1 step: up to ~7 float32 ulps near 1, from the rounding of ~20 float32 operations.
# Unlike Abramowitz & Stegun 7.1.26 (PyTorch's CPU erf: 1.5e-7 absolute, so a poor relative
# error for tiny |x|), tiny and subnormal x keep their relative accuracy, with no exp.
_ERF32_P = (29651.078, 5020.65, 1388.3456, 99.68774, 7.5007024, 0.05370131)
_ERF32_Q = (26277.586, 13208.611, 3005.5947, 394.82077, 30.724627, 1.0)
_ERF32_CLAMP = 3.92
# elements per block: NumPy's cost per call (~1 us, 15 calls a block) is what smaller blocks
# pay (32K-element blocks took 15-20% longer at 128K elements), and on two threads every
# call takes the GIL: with 64K-element blocks the threads waited on each other so much that
# two were no faster than one (GELU of 1M float32 on 2 cores: 6.1 ms, one thread 5.8 ms);
# with 256K, 3.9 ms (GELU's gradient 8.0 -> 5.7 ms; 4M elements 19.8 -> 13.3 ms). One thread
# takes the same time with any block from 64K to 512K: the passes stream from L3 as fast
_ERF32_CHUNK = 1 << 18


def _stacked(p, q):
    """P's and Q's coefficients as (2, 1) float32 columns, lowest degree first: Horner's rule
    runs on P and Q as the two rows of one array, half the NumPy calls of two loops."""
    return tuple(np.array([[a], [b]], np.float32) for a, b in zip(p, q, strict=True))


def _gelu_coefficients():
    """0.5 * erf(x / sqrt(2)) = x * P'(x^2) / Q'(x^2): the same rational with x^2 / 2 for x^2
    and both scaled by 2**deg (exact) so that Q' stays monic; GELU then needs no pass to scale x."""
    degree = len(_ERF32_Q) - 1
    p = [float(np.float32(c * 2.0 ** (degree - k) * 0.5 * _SQRT_HALF))
         for k, c in enumerate(_ERF32_P)]
    q = [c * 2.0 ** (degree - k) for k, c in enumerate(_ERF32_Q)]
    return p, q


_ERF32_PQ = _stacked(_ERF32_P, _ERF32_Q)
_GELU_PQ = _stacked(*_gelu_coefficients())
_ERF32_Z_MAX = np.full(_ERF32_CHUNK, np.float32(_ERF32_CLAMP) ** 2, np.float32)
_GELU_Z_MAX = np.full(_ERF32_CHUNK, np.float32(_ERF32_CLAMP / _SQRT_HALF) ** 2, np.float32)
_ERF32_Z_MAX.flags.writeable = _GELU_Z_MAX.flags.writeable = False


def _rational_odd(x, out, z, pq, coeffs, z_max):
    """x * P(z) / Q(z), z = min(x^2, clamp^2), into ``out``; ``z`` and ``pq`` (shape (2, n)):
    float32 scratch; ``z_max``: clamp^2 in a float32 array at least n long (NumPy's minimum
    against a scalar runs 3x slower than against an array). Multiplying by x, not by x
    clipped, saves a clip of x: beyond the clamp the result only grows past +-1 (erf) or
    +-0.5 (GELU), which the caller's clip then gives; NaN stays NaN."""
    with np.errstate(over="ignore"):  # |x| > 1.8e19: x^2 = inf, and min() bounds it
        np.multiply(x, x, out=z, dtype=np.float32)
    bound = z_max[:z.size] if z.size <= z_max.size else np.full(z.size, z_max[0])  # any block
    np.minimum(z, bound, out=z)
    np.multiply(z, coeffs[-1], out=pq)
    for coeff in coeffs[-2:0:-1]:
        pq += coeff
        pq *= z
    pq += coeffs[0]
    # P / Q (between 0.25 and 1.13 for erf) before the product: x up to float32's largest
    # does not overflow
    np.divide(pq[0], pq[1], out=pq[0])
    np.multiply(pq[0], x, out=out)


def _erf32_block(x, out, z, pq, pq_coeffs=_ERF32_PQ):
    """erf of a float32/float16 block into ``out``, clipped to [-1, 1]: |erf| <= 1 (rounding
    reaches 1 + 2.4e-7) and erf(x) = +-1 exactly beyond the clamp, where x * P / Q >= 1
    (scripts/fit_erf32.py checks it at the clamp; the product only grows with |x|)."""
    _rational_odd(x, out, z, pq, pq_coeffs, _ERF32_Z_MAX)
    np.clip(out, -1.0, 1.0, out=out)


def _gelu_cdf(x, cdf, z, pq):
    """Phi(x) = 0.5 + 0.5 * erf(x / sqrt(2)), clipped to [0, 1], into ``cdf``."""
    _rational_odd(x, cdf, z, pq, _GELU_PQ, _GELU_Z_MAX)
    cdf += 0.5
    np.clip(cdf, 0.0, 1.0, out=cdf)


def _gelu_block(x, out, z, pq):
    _gelu_cdf(x, out, z, pq)
    out *= x


_LOG_INV_SQRT_2PI = -0.5 * math.log(2.0 * math.pi)


def _gelu_grad_block(x, out, z, pq):
    """Phi(x) + x * phi(x), phi(x) = exp(-x^2 / 2 - log(sqrt(2 pi)))."""
    _gelu_cdf(x, out, z, pq)
    np.multiply(x, -0.5, out=z)
    with np.errstate(over="ignore"):  # |x| > 2.6e19: -inf, and exp() gives 0
        z *= x
    z += _LOG_INV_SQRT_2PI
    np.exp(z, out=z)
    z *= x
    out += z


# Phi(x) = gelu(x) / x only where x^2 / 2 does not underflow (|x| >= ~2**-75): there gelu(x)
# ~ x / 2 is a normal float32 and the quotient keeps its precision; closer to 0, Phi(x) rounds
# to 0.5 (it is 0.5 + 0.399 x).
def _gelu_grad_from_output_block(x, out, z, pq, y, dy):
    """dy * (Phi(x) + x * phi(x)), GeLU's gradient, with Phi(x) read off gelu(x) = x * Phi(x):
    one division instead of the ~15 passes of the erf (the forward computed them)."""
    np.multiply(x, -0.5, out=z)
    with np.errstate(over="ignore"):  # |x| > 2.6e19: -inf, and exp() gives 0
        z *= x
    near_zero = z == 0  # x == 0 (0 / 0) and |x| < ~2**-75 (a subnormal gelu(x))
    with np.errstate(divide="ignore", invalid="ignore"):
        np.divide(y, x, out=out)
    np.copyto(out, 0.5, where=near_zero)
    z += _LOG_INV_SQRT_2PI
    np.exp(z, out=z)
    z *= x
    out += z
    out *= dy


def _over_blocks(call, x, *also):
    """``call(x_part, out_part, *also_parts)`` over flat blocks of _ERF32_CHUNK elements of x
    (the result has x's dtype and shape) and of the arrays ``also`` (x's shape), split over
    threads as run_blocks decides. Each block is computed the same way wherever the cuts
    fall."""
    flat = np.ascontiguousarray(x).reshape(-1)
    flat_also = [np.ascontiguousarray(a).reshape(-1) for a in also]
    out = np.empty(flat.shape, x.dtype)
    run_blocks(lambda start, stop: call(flat[start:stop], out[start:stop],
                                        *(a[start:stop] for a in flat_also)),
               flat.size, _ERF32_CHUNK)
    return out.reshape(x.shape)


def _blockwise(block, x, *also):
    """``block(x_part, out_part, z, pq, *also_parts)`` over _over_blocks' blocks of x (float32
    or float16), with float32 scratch ``z`` (n,) and ``pq`` (2, n) for each."""

    def with_scratch(part, out, *also_parts):
        n = part.size
        block(part, out, np.empty(n, np.float32), np.empty((2, n), np.float32), *also_parts)

    return _over_blocks(with_scratch, x, *also)


def _float32_path(x):
    """float32 and float16 arrays take the float32 rational; float64 and others the exact erf."""
    return x.dtype == np.float32 or x.dtype == np.float16


def _erf_numpy(x):
    if not _float32_path(x):
        return _exact_erf(x).astype(x.dtype, copy=False)
    return _blockwise(_erf32_block, x)


_exact_erf_ufunc = np.frompyfunc(math.erf, 1, 1)


def _exact_erf(x):
    # np.asarray: on a 0-d array the object ufunc returns a bare Python float
    return np.asarray(_exact_erf_ufunc(x)).astype(np.float64)


def erf(xp, x):
    if xp is np:
        return _erf_numpy(np.asarray(x))
    return scipy_special(xp).erf(x)


def scipy_special(xp):
    """SciPy's special functions for a GPU array module: ``cupyx.scipy.special`` for CuPy.
    A stand-in array module (the CuPy API test's recorder) brings its own as
    ``xp.scipy_special``."""
    own = getattr(xp, "scipy_special", None)
    if own is not None:
        return own
    from cupyx.scipy import special  # noqa: PLC0415 - only with CuPy

    return special


def _compiled_blockwise(kernel, x, *also, extra=()):
    """``kernel(x_part, *also_parts, out_part, *extra)`` over _over_blocks' blocks of the
    float32 ``x`` (the compiled kernels release the GIL: the threads run them side by side)."""
    return _over_blocks(lambda part, out, *also_parts: kernel(part, *also_parts, out, *extra),
                        x, *also)


# the GELU rational's coefficients as the compiled kernel takes them (P's, Q's, the clamp)
_GELU_COEFFICIENTS = (np.array([c[0, 0] for c in _GELU_PQ], np.float32),
                      np.array([c[1, 0] for c in _GELU_PQ], np.float32), _GELU_Z_MAX[0])


def gelu_exact(xp, x):
    # NumPy float32: Phi from the float32 erf fit, in blocks, a few passes (or one, compiled);
    # within 2.8e-7 * |x| (tests/executor/test_erf_float32.py), |gelu(x)| <= |x| and of x's sign
    if xp is np and np.asarray(x).dtype == np.float32:
        x = np.asarray(x)
        compiled = compiled_kernels(xp, x.dtype, x.size)
        if compiled is not None:
            return _compiled_blockwise(compiled.gelu_flat, x, extra=_GELU_COEFFICIENTS)
        return _blockwise(_gelu_block, x)
    return 0.5 * x * (1.0 + erf(xp, x * _SQRT_HALF))


def gelu_exact_grad(xp, x):
    # NumPy float32: within 2.8e-7 absolute (tests/executor/test_erf_float32.py)
    if xp is np and np.asarray(x).dtype == np.float32:
        return _blockwise(_gelu_grad_block, np.asarray(x))
    cdf = 0.5 * (1.0 + erf(xp, x * _SQRT_HALF))
    pdf = xp.exp(-0.5 * x * x) * (1.0 / math.sqrt(2.0 * math.pi))
    return cdf + x * pdf


def gelu_exact_grad_from_output(dy, x, y):
    """The gradient ``dy`` * gelu'(x) of exact GeLU at the NumPy float32 ``x`` from ``y``, the
    float32 GeLU this module computed of the same x (gelu_exact): Phi(x) = y / x, so none of
    the erf's passes are repeated (the training step's GeluGrad took 1.6 ms, most of
    it the erf); ``dy``: float32 of x's shape. gelu'(x) is within 3e-7 absolute of the exact
    derivative (tests/executor/test_erf_float32.py)."""
    compiled = compiled_kernels(np, x.dtype, x.size)
    if compiled is not None:
        return _compiled_blockwise(compiled.gelu_grad_from_output_flat, x, y, dy,
                                   extra=(np.float32(_LOG_INV_SQRT_2PI),))
    return _blockwise(_gelu_grad_from_output_block, x, y, dy)


def _compiled_bias_rows(kernel, x, bias, *also, extra=()):
    """``kernel(x_rows, bias, *also_rows, out_rows, *extra)`` over row blocks of the float32
    ``x`` seen as (rows, D), ``bias`` of length D, the arrays ``also`` of x's shape, the
    blocks over threads as run_rows decides; the result has x's shape."""
    width = x.shape[-1]
    x2 = np.ascontiguousarray(x).reshape(-1, width)
    also2 = [np.ascontiguousarray(a).reshape(-1, width) for a in also]
    bias = np.ascontiguousarray(bias)
    out = np.empty(x2.shape, x.dtype)
    run_rows(np, lambda lo, hi: kernel(x2[lo:hi], bias, *(a[lo:hi] for a in also2),
                                       out[lo:hi], *extra), x2.shape[0], width)
    return out.reshape(x.shape)


def _bias_kernels(xp, x, bias):
    """The compiled kernels when ``x`` and ``bias`` are NumPy float32 with bias a vector along
    x's last axis (BiasGelu's contract), else None."""
    if (xp is not np or not all(isinstance(a, np.ndarray) and a.dtype == np.float32
                                for a in (x, bias))
            or x.ndim == 0 or bias.shape != x.shape[-1:]):
        return None
    return compiled_kernels(xp, x.dtype, x.size)


def bias_gelu_exact(xp, x, bias):
    """gelu(x + bias) in one pass, the sum not written out, where the compiled kernels run
    (NumPy float32, bias a vector along x's last axis); None elsewhere (the caller then
    takes gelu_exact of the sum)."""
    compiled = _bias_kernels(xp, x, bias)
    if compiled is not None:
        return _compiled_bias_rows(compiled.bias_gelu_rows, x, bias, extra=_GELU_COEFFICIENTS)
    return None


def bias_gelu_exact_grad_from_output(dy, x, bias, y):
    """gelu_exact_grad_from_output at x + bias (``y``: the forward's BiasGelu output; ``dy``
    and ``y`` float32 of x's shape, as for gelu_exact_grad_from_output), the sum not written
    out, where the compiled kernels run; None elsewhere."""
    compiled = _bias_kernels(np, x, bias)
    if compiled is not None:
        return _compiled_bias_rows(compiled.bias_gelu_grad_from_output_rows, x, bias, y, dy,
                                   extra=(np.float32(_LOG_INV_SQRT_2PI),))
    return None


_TANH_C = math.sqrt(2.0 / math.pi)
_TANH_K = 0.044715
_TANH_CONSTANTS = (np.float32(_TANH_C), np.float32(_TANH_K))


def gelu_tanh(xp, x):
    # NumPy float32 where the compiled kernels run: one pass (gelu_tanh_flat) instead of
    # seven; within 3e-7 * (1 + |x|) of float64 as this reference is
    # (tests/executor/test_compiled_kernels.py)
    if xp is np and isinstance(x, np.ndarray) and x.dtype == np.float32:
        compiled = compiled_kernels(xp, x.dtype, x.size)
        if compiled is not None:
            return _compiled_blockwise(compiled.gelu_tanh_flat, x, extra=_TANH_CONSTANTS)
    return 0.5 * x * (1.0 + xp.tanh(_TANH_C * (x + _TANH_K * x * x * x)))


def gelu_tanh_grad_times(xp, dy, x):
    """``dy * gelu_tanh_grad(x)``: one compiled pass for NumPy float32 ``dy`` and ``x`` of one
    shape where the compiled kernels run, the reference's passes elsewhere."""
    if (xp is np and all(isinstance(a, np.ndarray) and a.dtype == np.float32 for a in (dy, x))
            and dy.shape == x.shape):
        compiled = compiled_kernels(xp, x.dtype, x.size)
        if compiled is not None:
            return _compiled_blockwise(compiled.gelu_tanh_grad_flat, x, dy,
                                       extra=_TANH_CONSTANTS)
    return dy * gelu_tanh_grad(xp, x)


def gelu_tanh_grad(xp, x):
    inner = _TANH_C * (x + _TANH_K * x * x * x)
    th = xp.tanh(inner)
    return 0.5 * (1.0 + th) + 0.5 * x * (1.0 - th * th) * _TANH_C * (1.0 + 3.0 * _TANH_K * x * x)


def in_compute_dtype(fn):
    """Run ``fn(xp, x)`` in float32 for half-precision x and cast the result back."""

    def run(xp, x):
        ct = compute_dtype(x.dtype)
        if ct == x.dtype:
            return fn(xp, x)
        return fn(xp, x.astype(ct)).astype(x.dtype)

    return run

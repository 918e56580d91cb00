"""Helpers shared by kernel families."""

from __future__ import annotations

import math

import numpy as np
import onnx

from ._threads import parts_for, run_split

_SQRT_HALF = math.sqrt(0.5)


def np_dtype(onnx_elem_type: int) -> np.dtype:
    return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(onnx_elem_type))


def norm_axis(axis: int, rank: int) -> int:
    return axis + rank if axis < 0 else axis


def compute_dtype(dtype) -> np.dtype:
    """Float16/bfloat16 math runs in float32 and is rounded back, as GPU kernels do."""
    dtype = np.dtype(dtype)
    return np.dtype(np.float32) if dtype.itemsize < 4 and dtype.kind in "fV" else dtype


def row_sums(xp, x2d):
    """Sums of the rows of a 2-D float32/float64 array: einsum's, on NumPy 3-4x faster than
    a reduction along short rows (1024 rows of 64: 16 us against 58 us, issue 15), and,
    unlike a GEMV's, each row's bits independent of the rows beside it. The same call on
    every backend, so that a GPU computes what NumPy computes."""
    return xp.einsum("ij->i", x2d)


def column_sums(xp, x2d):
    """Sums over the rows of a 2-D float32/float64 array: on NumPy einsum's, the rows added in
    order as NumPy's reduction adds them (the same bits) at 2-4x its speed (1024 rows of 64:
    19 us against 44 us). A BLAS GEMV with ones is faster still when hot, but hands work to
    BLAS threads that a busy machine may not run in time (see blas_threads). From 256
    columns on NumPy's reduction is as fast or faster (1024 columns: 1.3x)."""
    if x2d.shape[1] >= 256:
        return x2d.sum(axis=0)
    return xp.einsum("ij->j", x2d)


def summed_by_rows(dtype) -> bool:
    """Whether the row kernels' (rows, D) paths apply: float32/float64 (half precision is
    computed in float32 before)."""
    return dtype in (np.float32, np.float64)


_ERFC_COEFFS = (-1.26551223, 1.00002368, 0.37409196, 0.09678418, -0.18628806, 0.27886807,
                 -1.13520398, 1.48851587, -0.82215223, 0.17087277)


# elements per block: the three float64 scratch buffers (384 KiB) still fit a 512 KiB L2, in
# half the calls of 8192-element blocks (10-20% less time at 128K and 1M elements, issue 15)
_ERF_CHUNK = 1 << 14


def _erf_numpy(x):
    if x.dtype == np.float64:
        return _exact_erf(x)
    # Rational Chebyshev fit of erfc (fractional error < 1.2e-7), evaluated in float64 (in
    # float32 the rounding would add up to 5e-7): Horner's rule in place, block by block so
    # that its twenty-odd passes run in cache, not memory.
    flat = np.ascontiguousarray(x).reshape(-1)
    out = np.empty(flat.shape, x.dtype)
    blocks = -(-flat.size // _ERF_CHUNK)
    run_split(lambda first, last: _erf_range(flat, out, first * _ERF_CHUNK,
                                             min(last * _ERF_CHUNK, flat.size)),
              blocks, parts_for(flat.size, blocks))
    return out.reshape(x.shape)


def _erf_range(flat, out, begin, end):
    size = min(_ERF_CHUNK, end - begin)
    if size <= 0:
        return
    z, t, poly = (np.empty(size, np.float64) for _ in range(3))
    for start in range(begin, end, _ERF_CHUNK):
        part = flat[start:min(start + _ERF_CHUNK, end)]
        n = part.size
        _erf_block(part, z[:n], t[:n], poly[:n])
        out[start:start + n] = poly[:n]


def _erf_block(x, z, t, poly):
    """erf(x) into ``poly`` (float64); ``z`` and ``t`` are scratch of x's size."""
    np.abs(x, out=z)
    # 1 / (1 + z/2) as 2 / (z + 2): scaling by 2 is exact, so both round alike (one pass less)
    np.add(z, 2.0, out=t)
    np.divide(2.0, t, out=t)
    np.multiply(t, _ERFC_COEFFS[-1], out=poly)
    for coeff in _ERFC_COEFFS[-2:0:-1]:
        poly += coeff
        poly *= t
    poly += _ERFC_COEFFS[0]
    np.multiply(z, z, out=z)
    poly -= z
    np.exp(poly, out=poly)
    poly *= t  # erfc(|x|)
    np.subtract(1.0, poly, out=poly)
    np.copysign(poly, x, out=poly)


_exact_erf_ufunc = np.frompyfunc(math.erf, 1, 1)


def _exact_erf(x):
    return _exact_erf_ufunc(x).astype(np.float64)


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


def gelu_exact(xp, x):
    return 0.5 * x * (1.0 + erf(xp, x * _SQRT_HALF))


def gelu_exact_grad(xp, x):
    cdf = 0.5 * (1.0 + erf(xp, x * _SQRT_HALF))
    pdf = xp.exp(-0.5 * x * x) * (1.0 / math.sqrt(2.0 * math.pi))
    return cdf + x * pdf


_TANH_C = math.sqrt(2.0 / math.pi)
_TANH_K = 0.044715


def gelu_tanh(xp, x):
    return 0.5 * x * (1.0 + xp.tanh(_TANH_C * (x + _TANH_K * x * x * x)))


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

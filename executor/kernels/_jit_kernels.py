"""numba kernels behind ``_compiled``: float32, one pass per row, the GIL released.

Every function computes what the NumPy passes it replaces compute, in the same order where
that order matters to the rounding (two-pass variance, P / Q before the product with x), so
the two paths agree within float32 rounding; tests/executor/test_compiled_kernels.py checks
each one against its NumPy path and against float64.

Fast-math flags: ``contract`` (fused multiply-add), ``nsz``, ``arcp`` and ``afn``; never
``nnan``/``ninf``, so NaN and infinities propagate as in NumPy. The row sums add ``reassoc``
so that they vectorise; ``_exp_nonpositive`` must not have it (its round-to-nearest trick,
``(y + 1.5 * 2**23) - 1.5 * 2**23``, would be folded away), and LLVM keeps each inlined
instruction's own flags. Compiled on first use and cached beside this file (numba's
``cache=True``), so later processes only load them.
"""

from __future__ import annotations

import numba
import numpy as np

_ROUNDING = {"contract", "nsz", "arcp", "afn"}  # numba takes a set (not a frozenset)
_SUMMING = _ROUNDING | {"reassoc"}
_OPTIONS = dict(nogil=True, cache=True, error_model="numpy")

_F = np.float32
_LOG2E = _F(1.4426950408889634)
_ROUNDER = _F(12582912.0)  # 1.5 * 2**23: y + it, minus it, is y rounded to an integer
_LN2_HI = _F(0.693359375)  # ln 2 = _LN2_HI - _LN2_LO, the high part exact in few bits
_LN2_LO = _F(2.12194440e-4)
# below this exp(x) is subnormal in float32 (NumPy's float32 exp returns the subnormal, this
# one 0: at most 1.2e-38 apart)
_EXP_FLOOR = _F(-87.33654)
_ONE = _F(1.0)
_HALF = _F(0.5)
_ZERO = _F(0.0)


def numba_version() -> str:
    return numba.__version__


def warm_up() -> None:
    """Starts numba's code generator by running one kernel (loading it from the cache, or
    compiling it the first time)."""
    rows = np.zeros((1, 8), np.float32)
    softmax_rows(rows, rows.copy())


@numba.njit(fastmath=_ROUNDING, **_OPTIONS)
def _exp_nonpositive(x):
    """float32 exp(x) for x <= 0 (Cephes' expf: 2**n * P(r), r = x - n ln 2, |r| <= ln 2 / 2),
    within 1 ulp for normal results; 0 below _EXP_FLOOR, NaN for NaN. Vectorises (no calls,
    no branches but selects), unlike NumPy's float32 exp on AVX2."""
    clamped = _EXP_FLOOR if x < _EXP_FLOOR else x  # NaN stays NaN
    shifted = clamped * _LOG2E + _ROUNDER
    n = shifted - _ROUNDER
    r = clamped - n * _LN2_HI + n * _LN2_LO
    p = _F(1.9875691500e-4)
    p = p * r + _F(1.3981999507e-3)
    p = p * r + _F(8.3334519073e-3)
    p = p * r + _F(4.1665795894e-2)
    p = p * r + _F(1.6666665459e-1)
    p = p * r + _F(5.0000001201e-1)
    p = p * (r * r) + r + _ONE
    # 2**n from n's bits: shifted's low mantissa bits hold n + 1.5 * 2**23's integer part
    exponent = np.int32(_F(shifted).view(np.int32) - np.int32(0x4B400000 - 127))
    power = np.int32(exponent << np.int32(23)).view(np.float32)
    return _ZERO if x < _EXP_FLOOR else p * power


# _ROW_SCRATCH: a kernel whose output may be its input (a donated buffer) computes a row into
# a scratch row first and copies it: LLVM vectorises a loop only after checking at run time
# that its output does not overlap its inputs, and runs the scalar loop when it does, even
# where each element is read before it is written (the MQA block's in-place softmax: 63 ms
# scalar, 9 ms vectorised)


@numba.njit(**_OPTIONS)
def _row_peak(keys):
    """The largest float32 of a row given as its int32 bits, by an integer maximum (which
    vectorises; a float one does not without assuming away NaN): bits ^ ((bits >> 31) &
    0x7FFFFFFF) orders the floats as integers, with a NaN of positive sign above +inf (the
    peak is then NaN) and one of negative sign below -inf (its exp is NaN all the same)."""
    best = np.int32(-2147483648)
    for j in range(keys.size):
        bits = keys[j]
        key = bits ^ ((bits >> np.int32(31)) & np.int32(0x7FFFFFFF))
        best = key if key > best else best
    bits = np.int32(best ^ ((best >> np.int32(31)) & np.int32(0x7FFFFFFF)))
    return bits.view(np.float32)


@numba.njit(fastmath=_SUMMING, **_OPTIONS)
def softmax_rows(x, out):
    """Softmax of each row of the C-contiguous (rows, width) float32 ``x`` into ``out`` (may be
    x). A row holding NaN or +inf, or only -inf, comes out NaN, as NumPy's does."""
    rows, width = x.shape
    exps = np.empty(width, np.float32)  # see _ROW_SCRATCH
    keys = x.view(np.int32)
    for i in range(rows):
        peak = _row_peak(keys[i])
        total = _ZERO
        for j in range(width):
            e = _exp_nonpositive(x[i, j] - peak)
            exps[j] = e
            total += e
        inverse = _ONE / total
        for j in range(width):
            out[i, j] = exps[j] * inverse


_CHUNK = 256


@numba.njit(fastmath=_ROUNDING, **_OPTIONS)
def exp_of_nonpositive(x, out):
    """exp of every element of the flat float32 ``x`` into ``out`` (may be x) and True, when
    no element is above 0 (log-probabilities, scores less their row maximum; NaN allowed);
    False, writing nothing, when one is: the caller then takes NumPy's exp."""
    positives = 0
    for j in range(x.size):  # a count, not an early exit: the count vectorises
        if x[j] > _ZERO:
            positives += 1
    if positives:
        return False
    # through a scratch of a fixed size (see _ROW_SCRATCH; with a size known only at run time
    # the loops did not vectorise: 57K elements, 122 us against 45)
    chunk = np.empty(_CHUNK, np.float32)
    whole = x.size - x.size % _CHUNK
    for start in range(0, whole, _CHUNK):
        for j in range(_CHUNK):
            chunk[j] = _exp_nonpositive(x[start + j])
        for j in range(_CHUNK):
            out[start + j] = chunk[j]
    for j in range(whole, x.size):
        chunk[j - whole] = _exp_nonpositive(x[j])
    for j in range(whole, x.size):
        out[j] = chunk[j - whole]
    return True


@numba.njit(fastmath=_ROUNDING, **_OPTIONS)
def log_softmax_classes(x, out):
    """log_softmax over the middle axis of the C-contiguous float32 (N, C, D) ``x`` into
    ``out`` (a cross-entropy's scores: (batch, classes, positions)): the maximum, the sum of
    exps and the result run along D for each class, contiguous, so they vectorise across the
    positions. A position holding NaN or +inf, or only -inf, gets NaN, as NumPy's does."""
    count, classes, width = x.shape
    peak = np.empty(width, np.float32)
    total = np.empty(width, np.float32)
    for n in range(count):
        for d in range(width):
            peak[d] = x[n, 0, d]
        for c in range(1, classes):
            for d in range(width):
                value = x[n, c, d]
                peak[d] = value if value > peak[d] else peak[d]  # a NaN peak stays NaN
        for d in range(width):
            total[d] = _ZERO
        for c in range(classes):
            for d in range(width):
                total[d] += _exp_nonpositive(x[n, c, d] - peak[d])
        for d in range(width):  # peak + log(total), the shift of every class at d
            total[d] = peak[d] + np.log(total[d])
        for c in range(classes):
            for d in range(width):
                out[n, c, d] = x[n, c, d] - total[d]


@numba.njit(fastmath=_SUMMING, **_OPTIONS)
def log_softmax_rows(x, out):
    """log_softmax of each row of the C-contiguous (rows, width) float32 ``x`` into ``out``
    (not x): a cross-entropy's scores whose classes lie innermost in memory (the logits of a
    language model, transposed to put the classes on axis 1). NaN where log_softmax_classes
    gives it."""
    rows, width = x.shape
    keys = x.view(np.int32)
    for i in range(rows):
        peak = _row_peak(keys[i])
        total = _ZERO
        for j in range(width):
            total += _exp_nonpositive(x[i, j] - peak)
        shift = peak + np.log(total)
        for j in range(width):
            out[i, j] = x[i, j] - shift


@numba.njit(fastmath=_SUMMING, **_OPTIONS)
def softmax_grad_rows(dy, y, dx):
    """y * (dy - sum(y * dy)) row by row into ``dx`` (may be dy: each element of a row is read
    before it is written)."""
    rows, width = y.shape
    row = np.empty(width, np.float32)  # see _ROW_SCRATCH
    for i in range(rows):
        total = _ZERO
        for j in range(width):
            total += y[i, j] * dy[i, j]
        for j in range(width):
            row[j] = (dy[i, j] - total) * y[i, j]
        for j in range(width):
            dx[i, j] = row[j]


@numba.njit(fastmath=_SUMMING, **_OPTIONS)
def layer_norm_rows(x, scale, bias, epsilon, y, mean, inv_std):
    """y = (x - mean) * inv_std * scale + bias row by row (bias of length 0: none), with the
    row ``mean`` and ``inv_std`` = 1 / sqrt(var + epsilon), the variance from the centered
    row (two passes, as the NumPy path)."""
    rows, width = x.shape
    has_bias = bias.size > 0
    for i in range(rows):
        total = _ZERO
        for j in range(width):
            total += x[i, j]
        row_mean = total / _F(width)
        squares = _ZERO
        for j in range(width):
            centered = x[i, j] - row_mean
            squares += centered * centered
        inverse = _ONE / np.sqrt(squares / _F(width) + epsilon)
        mean[i] = row_mean
        inv_std[i] = inverse
        if has_bias:
            for j in range(width):
                y[i, j] = (x[i, j] - row_mean) * inverse * scale[j] + bias[j]
        else:
            for j in range(width):
                y[i, j] = (x[i, j] - row_mean) * inverse * scale[j]


@numba.njit(fastmath=_SUMMING, **_OPTIONS)
def layer_norm_grad_rows(dy, x, scale, mean, inv_std, dx, scale_sums, bias_sums):
    """LayerNorm's gradients over a block of rows: dx = inv_std * (dxhat - mean(dxhat) -
    xhat * mean(dxhat * xhat)), dxhat = dy * scale, xhat = (x - mean) * inv_std; and the
    block's share of the parameter gradients added into ``scale_sums`` (dy * xhat summed
    over the rows) and ``bias_sums`` (dy summed), rows in order."""
    rows, width = x.shape
    xhat = np.empty(width, np.float32)
    for i in range(rows):
        row_mean = mean[i]
        inverse = inv_std[i]
        dxhat_total = _ZERO
        product_total = _ZERO
        for j in range(width):
            normalized = (x[i, j] - row_mean) * inverse
            xhat[j] = normalized
            gradient = dy[i, j]
            dxhat = gradient * scale[j]
            dxhat_total += dxhat
            product_total += dxhat * normalized
            scale_sums[j] += gradient * normalized
            bias_sums[j] += gradient
        dxhat_mean = dxhat_total / _F(width)
        product_mean = product_total / _F(width)
        for j in range(width):
            dx[i, j] = (dy[i, j] * scale[j] - dxhat_mean - xhat[j] * product_mean) * inverse


@numba.njit(inline="always")
def _gelu_of(v, p0, p1, p2, p3, p4, p5, q0, q1, q2, q3, q4, q5, z_max):
    """v * Phi(v) with gelu_flat's rational (inlined into each kernel, under its flags)."""
    z = v * v
    z = z_max if z > z_max else z
    numerator = ((((p5 * z + p4) * z + p3) * z + p2) * z + p1) * z + p0
    denominator = ((((q5 * z + q4) * z + q3) * z + q2) * z + q1) * z + q0
    cdf = numerator / denominator * v + _HALF
    cdf = _ZERO if cdf < _ZERO else cdf
    cdf = _ONE if cdf > _ONE else cdf
    return cdf * v


@numba.njit(fastmath=_ROUNDING, **_OPTIONS)
def gelu_flat(x, out, p, q, z_max):
    """x * Phi(x) over a flat float32 block, Phi(x) = 0.5 + x * P(z) / Q(z), z = min(x^2,
    z_max), clipped to [0, 1]: the NumPy path's rational (``_util._GELU_PQ``: ``p``, ``q``
    lowest degree first, six each) in the same order."""
    p0, p1, p2, p3, p4, p5 = p[0], p[1], p[2], p[3], p[4], p[5]
    q0, q1, q2, q3, q4, q5 = q[0], q[1], q[2], q[3], q[4], q[5]
    for j in range(x.size):
        out[j] = _gelu_of(x[j], p0, p1, p2, p3, p4, p5, q0, q1, q2, q3, q4, q5, z_max)


@numba.njit(fastmath=_ROUNDING, **_OPTIONS)
def bias_gelu_rows(x, bias, out, p, q, z_max):
    """gelu(x + bias) over the rows of the C-contiguous float32 (rows, D) ``x``, ``bias`` of
    length D: gelu_flat of each sum, without the sum written out (com.microsoft BiasGelu)."""
    p0, p1, p2, p3, p4, p5 = p[0], p[1], p[2], p[3], p[4], p[5]
    q0, q1, q2, q3, q4, q5 = q[0], q[1], q[2], q[3], q[4], q[5]
    rows, width = x.shape
    for i in range(rows):
        for j in range(width):
            out[i, j] = _gelu_of(x[i, j] + bias[j], p0, p1, p2, p3, p4, p5,
                                 q0, q1, q2, q3, q4, q5, z_max)


@numba.njit(inline="always")
def _gelu_grad_of(v, y, dy, log_inv_sqrt_2pi):
    """dy * (Phi(v) + v * phi(v)), Phi(v) = y / v read off the forward's gelu(v)."""
    z = v * _F(-0.5) * v
    cdf = _HALF if z == _ZERO else y / v
    return (cdf + _exp_nonpositive(z + log_inv_sqrt_2pi) * v) * dy


@numba.njit(fastmath=_ROUNDING, **_OPTIONS)
def gelu_grad_from_output_flat(x, y, dy, out, log_inv_sqrt_2pi):
    """dy * (Phi(x) + x * phi(x)) over flat float32 blocks with Phi(x) = gelu(x) / x read off
    the forward's ``y`` (0.5 where x^2 / 2 underflows to 0) and phi(x) = exp(-x^2 / 2 -
    log(sqrt(2 pi))): ``_util._gelu_grad_from_output_block`` in one pass."""
    for j in range(x.size):
        out[j] = _gelu_grad_of(x[j], y[j], dy[j], log_inv_sqrt_2pi)


@numba.njit(fastmath=_ROUNDING, **_OPTIONS)
def bias_gelu_grad_from_output_rows(x, bias, y, dy, out, log_inv_sqrt_2pi):
    """gelu_grad_from_output_flat at x + bias over the rows of the C-contiguous float32
    (rows, D) arrays, ``bias`` of length D (com.microsoft BiasGeluGrad_dX read off the
    forward's BiasGelu), the sum not written out."""
    rows, width = x.shape
    for i in range(rows):
        for j in range(width):
            out[i, j] = _gelu_grad_of(x[i, j] + bias[j], y[i, j], dy[i, j], log_inv_sqrt_2pi)


@numba.njit(fastmath=_ROUNDING, **_OPTIONS)
def _tanh_of(u):
    """float32 tanh(u) = sign(u) (1 - e) / (1 + e), e = exp(-2 |u|) <= 1 (_exp_nonpositive:
    vectorises where a call to tanh does not); within 2e-7 absolute of NumPy's."""
    e = _exp_nonpositive(_F(-2.0) * abs(u))
    t = (_ONE - e) / (_ONE + e)
    return -t if u < _ZERO else t


@numba.njit(fastmath=_ROUNDING, **_OPTIONS)
def gelu_tanh_flat(x, out, c, k):
    """0.5 x (1 + tanh(c (x + k x^3))) over a flat float32 block (GELU's tanh form: ONNX Gelu
    approximate="tanh", com.microsoft FastGelu), ``_util.gelu_tanh`` in one pass."""
    for j in range(x.size):
        v = x[j]
        out[j] = _F(0.5) * v * (_ONE + _tanh_of(c * (v + k * v * v * v)))


@numba.njit(fastmath=_ROUNDING, **_OPTIONS)
def gelu_tanh_grad_flat(x, dy, out, c, k):
    """dy * d/dx of gelu_tanh_flat's GELU over flat float32 blocks, ``_util.gelu_tanh_grad``
    times dy in one pass."""
    for j in range(x.size):
        v = x[j]
        t = _tanh_of(c * (v + k * v * v * v))
        grad = _F(0.5) * (_ONE + t) + _F(0.5) * v * (_ONE - t * t) * c * (
            _ONE + _F(3.0) * k * v * v)
        out[j] = dy[j] * grad


@numba.njit(**_OPTIONS)
def adamw_flat(param, grad, m, v, decay, beta1, one_minus_beta1, beta2, one_minus_beta2,
               sqrt_bias2, eps, step_size):
    """One AdamW update of flat float32 arrays in place, in one pass: the trainer's NumPy
    update's float32 operations in its order, each rounded (no fast-math: no contraction
    into FMAs, IEEE division and sqrt), so the bits are NumPy's."""
    for j in range(param.size):
        g = grad[j]
        mj = m[j] * beta1 + one_minus_beta1 * g
        vj = v[j] * beta2 + (one_minus_beta2 * g) * g
        m[j] = mj
        v[j] = vj
        param[j] = param[j] * decay - step_size * (mj / (np.sqrt(vj) / sqrt_bias2 + eps))


@numba.njit(**_OPTIONS)
def scatter_add_rows(out, rows, updates):
    """``out[rows[i]] += updates[i]`` for i in order: ``np.add.at``'s loop, so its bits (each
    element's additions in update order; no fast-math, whose reassociation would change
    them). ``out``: C-contiguous (R, C) float32; ``rows``: (n,) int64, a negative one
    counting from the end as in NumPy; ``updates``: C-contiguous (n, C) float32. Returns -1,
    or the position of the first row outside [-R, R), before any update is made (NumPy's
    add.at raises there, leaving ``out`` as it was too)."""
    limit = out.shape[0]
    for i in range(rows.size):
        if rows[i] < -limit or rows[i] >= limit:
            return i
    for i in range(rows.size):
        row = rows[i]
        target = out[row + limit if row < 0 else row]
        source = updates[i]
        for j in range(target.size):
            target[j] += source[j]
    return -1

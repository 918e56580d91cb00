"""The NumPy executor's float32 erf (executor/kernels/_util.py) is a rational fit
evaluated in float32; its error is measured here against math.erf in float64 on a dense sweep,
random bit patterns and edge values, and pinned: the bounds are the measured maxima rounded up
by a little, so a perturbed coefficient (or evaluation order) fails them. GELU and its
gradient, which use the same fit, are held to the same standard."""

import importlib.util
import math
from pathlib import Path

import numpy as np
import pytest

from graphopt.executor.kernels import _util
from graphopt.executor.kernels._util import (
    _ERF32_CLAMP,
    _ERF32_P,
    _ERF32_Q,
    _erf32_block,
    _stacked,
    erf,
    gelu_exact,
    gelu_exact_grad,
    gelu_exact_grad_from_output,
)

ROOT = Path(__file__).resolve().parents[2]
# measured maxima (see _util.py), rounded up
ERF_ABS = 4.4e-7           # |erf32(x) - erf(x)|, every x (4.356e-7 at WORST_X)
ERF_REL = 4.4e-7           # |erf32(x) - erf(x)| / |erf(x)|, |erf(x)| >= 2**-126 (likewise)
SUBNORMAL_ULPS = 1         # below: in steps of 2**-149 (0.95)
# the worst float32 of all (scripts/fit_erf32.py --exhaustive), in the sweep
WORST_X = 3.2803822
GELU_REL = 2.8e-7          # |gelu32(x) - gelu(x)| / |x| (2.72e-7)
GELU_GRAD_ABS = 2.8e-7     # |gelu'32(x) - gelu'(x)|, gelu' in [-0.17, 1.13] (2.76e-7)
# the same, with Phi(x) read off the forward's float32 gelu(x) / x (3.29e-7): the quotient adds
# two roundings
GELU_GRAD_FROM_OUTPUT_ABS = 3.3e-7
# the compiled kernels (executor/kernels/_jit_kernels.py) evaluate the same rational with fused
# multiply-adds in one pass: GELU within 2.00e-7 * |x|, its gradient read off the output
# within 2.58e-7
COMPILED_GELU_REL = 2.1e-7
COMPILED_GELU_GRAD_FROM_OUTPUT_ABS = 2.6e-7
TINY = 2.0 ** -126

_exact = np.frompyfunc(math.erf, 1, 1)


def _erf64(x):
    return _exact(np.asarray(x, np.float64)).astype(np.float64)


def _sweep():
    """Dense over [-10, 10], random bit patterns (every exponent), tiny and subnormal x, the
    clamp's neighbours, the largest floats; no NaN (tested apart)."""
    rng = np.random.default_rng(15)
    bits = rng.integers(0, 2**32, 400_000, dtype=np.uint64).astype(np.uint32).view(np.float32)
    clamp = np.float32(_ERF32_CLAMP)
    edges = [0.0, 1e-45, 2e-45, 1e-40, TINY, 1e-30, 1e-10, 1e-4, WORST_X, np.nextafter(clamp, 0),
             clamp, np.nextafter(clamp, np.float32(np.inf)), 10.0, 1e30,
             np.finfo(np.float32).max, np.inf]
    x = np.concatenate([np.linspace(-10, 10, 2_000_001, dtype=np.float32), bits[~np.isnan(bits)],
                        (10.0 ** rng.uniform(-45, 1, 200_000)).astype(np.float32),
                        np.array(edges, np.float32)])
    return np.concatenate([x, -x])


SWEEP = _sweep()
REF = _erf64(SWEEP)


def _errors(got):
    err = np.abs(got.astype(np.float64) - REF)
    normal = np.abs(REF) >= TINY
    return err, (err[normal] / np.abs(REF[normal])).max(), err[~normal].max() / 2.0 ** -149


def test_erf_float32_is_within_its_measured_error():
    got = erf(np, SWEEP)
    assert got.dtype == np.float32
    err, rel, subnormal_ulps = _errors(got)
    assert err.max() <= ERF_ABS
    assert rel <= ERF_REL
    assert subnormal_ulps <= SUBNORMAL_ULPS
    # a bound much looser than the measurement would pin nothing
    assert err.max() > 0.9 * ERF_ABS and rel > 0.9 * ERF_REL


def _erf_with(p, q):
    x = SWEEP
    out = np.empty_like(x)
    _erf32_block(x, out, np.empty_like(x), np.empty((2, x.size), np.float32), _stacked(p, q))
    return out


@pytest.mark.parametrize("index", range(len(_ERF32_P) + len(_ERF32_Q) - 1))
def test_a_perturbed_coefficient_breaks_the_bounds(index):
    p, q = list(_ERF32_P), list(_ERF32_Q)
    coeffs, k = (p, index) if index < len(p) else (q, index - len(p))
    coeffs[k] *= 1.0 + 1e-5
    err, rel, _ = _errors(_erf_with(p, q))
    assert err.max() > ERF_ABS or rel > ERF_REL


def test_the_fit_script_prints_these_coefficients():
    spec = importlib.util.spec_from_file_location("fit_erf32", ROOT / "scripts" / "fit_erf32.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    a, b, _ = script.fit()
    np.testing.assert_allclose(np.float32(a), _ERF32_P, rtol=1e-6)
    np.testing.assert_allclose(np.float32(b), _ERF32_Q, rtol=1e-6)
    assert script.CLAMP == _ERF32_CLAMP
    # its float32 evaluation, whose error it prints, is the executor's, bit for bit
    x = SWEEP[np.abs(SWEEP) <= 1e30]
    np.testing.assert_array_equal(script.evaluate_float32(x, _ERF32_P, _ERF32_Q).view(np.uint32),
                                  erf(np, x).view(np.uint32))
    # beyond the clamp the unclipped x * P / Q must be >= 1 for the clip to give exactly 1
    assert script.evaluate_float32(np.float32(_ERF32_CLAMP), _ERF32_P, _ERF32_Q, clip=False) >= 1


def test_erf_float32_edge_values():
    x = np.array([np.inf, -np.inf, 0.0, -0.0, np.nan, 4.0, -4.0, 3.0e38], np.float32)
    got = erf(np, x)
    np.testing.assert_array_equal(got[[0, 1, 5, 6, 7]], [1, -1, 1, -1, 1])
    assert got[2] == 0 and not np.signbit(got[2]) and np.signbit(got[3])
    assert np.isnan(got[4])
    assert np.abs(erf(np, SWEEP)).max() <= 1.0
    # GELU's clamp (3.92 * sqrt(2)) likewise: Phi is exactly 1 or 0 beyond it
    big = np.array([5.6, 10.0, 1e20, 3e38], np.float32)
    np.testing.assert_array_equal(gelu_exact(np, big), big)
    np.testing.assert_array_equal(gelu_exact(np, -big), 0.0)
    np.testing.assert_array_equal(gelu_exact_grad(np, big[1:]), 1.0)


def test_erf_float32_is_odd_bit_for_bit():
    x = SWEEP[:SWEEP.size // 2]
    np.testing.assert_array_equal(erf(np, -x).view(np.uint32), (-erf(np, x)).view(np.uint32))


def test_float64_keeps_the_exact_erf_and_float16_rounds_the_float32_one():
    x = np.linspace(-5, 5, 2001)
    np.testing.assert_array_equal(erf(np, x), _erf64(x))
    assert erf(np, np.float64(0.5)) == math.erf(0.5)  # a 0-d array too
    h = x.astype(np.float16)
    got = erf(np, h)
    assert got.dtype == np.float16
    exact = _erf64(h).astype(np.float16)
    assert (np.abs(got.astype(np.float64) - exact) <= np.spacing(np.abs(exact))).all()


def _gelu64(x):
    return 0.5 * x * (1.0 + _erf64(x * math.sqrt(0.5)))


def test_gelu_and_its_gradient_float32_are_within_their_measured_error(kernel_path):
    gelu_rel = COMPILED_GELU_REL if kernel_path == "compiled" else GELU_REL
    x = np.concatenate([np.linspace(-12, 12, 1_000_001, dtype=np.float32),
                        (10.0 ** np.random.default_rng(0).uniform(-37, 1, 100_000)).astype(
                            np.float32)])  # gelu(x) stays a normal float
    x = np.concatenate([x, -x])
    x64 = x.astype(np.float64)
    got = gelu_exact(np, x)
    nonzero = x != 0
    rel = np.abs(got.astype(np.float64) - _gelu64(x64))[nonzero] / np.abs(x64[nonzero])
    assert got.dtype == np.float32 and 0.9 * gelu_rel < rel.max() <= gelu_rel
    grad = _gelu64(x64) / np.where(nonzero, x64, 1) + x64 * np.exp(-0.5 * x64 * x64) / math.sqrt(
        2 * math.pi)
    grad[~nonzero] = 0.5
    err = np.abs(gelu_exact_grad(np, x).astype(np.float64) - grad)
    assert 0.9 * GELU_GRAD_ABS < err.max() <= GELU_GRAD_ABS
    # GELU is bounded by its input and 0, and by the float64 formula's sign for large |x|
    assert (np.abs(got) <= np.abs(x)).all() and (got * x >= 0).all()


def _gelu_sweep():
    x = np.concatenate([np.linspace(-12, 12, 1_000_001, dtype=np.float32),
                        (10.0 ** np.random.default_rng(0).uniform(-37, 1, 100_000)).astype(
                            np.float32)])
    return np.concatenate([x, -x])


def test_gelu_gradient_read_off_the_forward_output_is_within_its_measured_error(kernel_path):
    compiled = kernel_path == "compiled"
    bound = COMPILED_GELU_GRAD_FROM_OUTPUT_ABS if compiled else GELU_GRAD_FROM_OUTPUT_ABS
    x = _gelu_sweep()
    x64 = x.astype(np.float64)
    nonzero = x != 0
    exact = _gelu64(x64) / np.where(nonzero, x64, 1) + x64 * np.exp(
        -0.5 * x64 * x64) / math.sqrt(2 * math.pi)
    exact[~nonzero] = 0.5
    got = gelu_exact_grad_from_output(np.ones_like(x), x, gelu_exact(np, x))
    err = np.abs(got.astype(np.float64) - exact)
    assert got.dtype == np.float32 and 0.9 * bound < err.max() <= bound
    # at most one float32 step from the gradient computed from x alone by the same passes (the
    # compiled path: three, as it rounds differently)
    assert np.abs(got - gelu_exact_grad(np, x)).max() <= (3 if compiled else 1) * 2.0 ** -23


def test_gelu_gradient_read_off_the_output_near_zero_and_at_the_edges(kernel_path):
    tiny = np.float32(2.0 ** -76)  # x^2 / 2 underflows: Phi(x) is 0.5
    x = np.array([0.0, -0.0, 1e-45, -1e-45, 1e-40, tiny, -tiny, 2.0 ** -74, 1e-30, -1e-20,
                  1e-8, 3e38, -3e38, 6.0, -6.0, 40.0, -40.0], np.float32)
    got = gelu_exact_grad_from_output(np.ones_like(x), x, gelu_exact(np, x))
    np.testing.assert_array_equal(got[:7], 0.5)
    # the quotient of a normal gelu(x) by x: as close as the path from x alone
    np.testing.assert_allclose(got, gelu_exact_grad(np, x), rtol=0,
                               atol=(3 if kernel_path == "compiled" else 1) * 2.0 ** -23)
    odd = np.array([np.inf, -np.inf, np.nan], np.float32)
    with np.errstate(invalid="ignore"):
        from_output = gelu_exact_grad_from_output(np.ones_like(odd), odd, gelu_exact(np, odd))
        np.testing.assert_array_equal(from_output, gelu_exact_grad(np, odd))


def test_gelu_gradient_read_off_the_output_is_dy_times_the_derivative_in_every_block(
        monkeypatch):
    monkeypatch.setenv("GRAPHOPT_COMPILED_KERNELS", "0")  # the NumPy passes' blocks
    rng = np.random.default_rng(5)
    x = rng.standard_normal(3 * _util._ERF32_CHUNK + 17).astype(np.float32) * 3
    dy = rng.standard_normal(x.size).astype(np.float32)
    y = gelu_exact(np, x)
    got = gelu_exact_grad_from_output(dy, x, y)
    one_block = np.empty_like(x)
    z, pq = np.empty(x.size, np.float32), np.empty((2, x.size), np.float32)
    _util._gelu_grad_from_output_block(x, one_block, z, pq, y, np.ones_like(x))
    np.testing.assert_array_equal(got, dy * one_block)


def test_other_arrays_keep_the_general_path():
    assert _util.gelu_exact(np, np.array([1.0])).dtype == np.float64
    np.testing.assert_allclose(gelu_exact_grad(np, np.array([0.0, 1.0])),
                               [0.5, 0.5 * (1 + math.erf(math.sqrt(0.5))) +
                                math.exp(-0.5) / math.sqrt(2 * math.pi)], rtol=1e-15)

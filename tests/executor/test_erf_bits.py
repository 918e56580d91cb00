"""The NumPy erf (executor/kernels/_util.py) is evaluated in blocks with its passes arranged
for speed (issue 15); its bits must stay those of the plain formula, written out here once:
Numerical Recipes' erfc fit t * exp(-z^2 + P(t)), t = 1 / (1 + z/2), z = |x|, in float64."""

import numpy as np

from graphopt.executor.kernels._util import _ERFC_COEFFS, erf


def _plain_erf(x):
    z = np.abs(x.astype(np.float64))
    t = 1.0 / (1.0 + 0.5 * z)
    poly = t * _ERFC_COEFFS[-1]
    for coeff in _ERFC_COEFFS[-2:0:-1]:
        poly = (poly + coeff) * t
    erfc = np.exp(poly + _ERFC_COEFFS[0] - z * z) * t
    return np.copysign(1.0 - erfc, x).astype(np.float32)


def test_erf_bits_equal_the_plain_formula():
    rng = np.random.default_rng(0)
    with np.errstate(invalid="ignore", over="ignore"):
        bits = rng.integers(0, 2**32, 300_000, dtype=np.uint64).astype(np.uint32)
        x = np.concatenate([bits.view(np.float32),
                            rng.standard_normal(300_000).astype(np.float32) * 3,
                            np.array([0.0, -0.0, 1e-45, -1e-45, np.inf, -np.inf], np.float32)])
        x = x[~np.isnan(x)]
        np.testing.assert_array_equal(erf(np, x).view(np.uint32),
                                      _plain_erf(x).view(np.uint32))

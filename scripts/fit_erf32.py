"""Fit the rational approximation of erf used by the NumPy executor's float32 path.

erf(x) ~= x * P(x^2) / Q(x^2) for |x| <= CLAMP (degrees DEG_P, DEG_Q in x^2, Q monic), and
+-1 beyond (erf(x) rounds to +-1 in float32 for |x| > 3.92). The coefficients minimise the
largest *relative* error of erf on [0, CLAMP] (so tiny |x| stays accurate): a linearised
least-squares fit (P - g*Q with g = erf(x)/x) reweighted by Lawson's iteration towards the
minimax solution, in float64 with NumPy. Prints the coefficients, rounded to float32, as the
tuples that executor/kernels/_util.py holds, and the error of the float32 evaluation that the
executor runs (the fit's own error is far below float32 rounding).

    python scripts/fit_erf32.py [--exhaustive]

--exhaustive also measures the error on every float32 in [0, CLAMP] (a billion values, about a
minute; erf is odd bit for bit and +-1 beyond, so that is every float32), against SciPy's
float64 erf (SciPy comes with the test extra's scikit-learn).
"""

from __future__ import annotations

import math
import sys

import numpy as np

DEG_P, DEG_Q = 5, 5
CLAMP = 3.92
_TWO_OVER_SQRT_PI = 2.0 / math.sqrt(math.pi)


def _erf(x):
    return np.array([math.erf(v) for v in np.asarray(x, np.float64).ravel()]).reshape(np.shape(x))


def fit(deg_p=DEG_P, deg_q=DEG_Q, clamp=CLAMP, samples=4000, iterations=60):
    """(a, b, error): P's and Q's coefficients in x^2, lowest degree first, Q monic; error is
    the largest relative error of x * P / Q against erf on the samples, in float64."""
    scale = clamp * clamp
    s = (1.0 - np.cos(np.linspace(0.0, math.pi, samples))) / 2.0  # x^2 / clamp^2, dense at ends
    x = np.sqrt(s * scale)
    g = np.full(samples, _TWO_OVER_SQRT_PI)
    g[1:] = _erf(x[1:]) / x[1:]
    powers_p = s[:, None] ** np.arange(deg_p + 1)
    powers_q = s[:, None] ** np.arange(1, deg_q + 1)
    weight, q_prev, best = np.ones(samples), np.ones(samples), None
    for _ in range(iterations):
        # P(s) - g * (Q(s) - 1) = g with Q(0) = 1, relative to g * Q: linear in the unknowns
        lhs = np.hstack([powers_p, -g[:, None] * powers_q])
        row = weight / (g * np.abs(q_prev))
        sol = np.linalg.lstsq(lhs * row[:, None], g * row, rcond=None)[0]
        a, b = sol[:deg_p + 1], np.concatenate([[1.0], sol[deg_p + 1:]])
        p, q = powers_p @ a, np.concatenate([np.ones((samples, 1)), powers_q], axis=1) @ b
        err = np.abs(p / q - g) / g
        if best is None or err.max() < best[2]:
            best = (a, b, err.max())
        q_prev = q
        weight = np.maximum(weight * err / (weight * err).sum(), 1e-12)  # Lawson
    a, b, error = best
    a, b = a / scale ** np.arange(deg_p + 1), b / scale ** np.arange(deg_q + 1)
    return a / b[-1], b / b[-1], error


def evaluate_float32(x, a, b, clamp=CLAMP, clip=True):
    """erf as the executor computes it, bit for bit (the test checks it), in float32 (a, b:
    float32 coefficient tuples); the result is clipped to [-1, 1] unless ``clip`` is false."""
    x = np.asarray(x, np.float32)
    u = np.clip(x, -np.float32(clamp), np.float32(clamp))
    z = u * u
    p = z * a[-1]
    for coeff in a[-2:0:-1]:
        p = (p + coeff) * z
    p = p + a[0]
    q = z + b[-2]
    for coeff in b[-3::-1]:
        q = q * z + coeff
    r = p / q * x  # beyond the clamp x * P / Q >= 1: clipped to 1
    return np.clip(r, -1.0, 1.0) if clip else r


def exhaustive(a, b, clamp=CLAMP, step=1 << 24):
    """(max abs error, its x, max relative error where erf >= 2**-126, its x, max error in
    2**-149 steps where erf < 2**-126) over every float32 in [0, clamp]."""
    from scipy.special import erf as erf64  # noqa: PLC0415 - only for --exhaustive

    end = int(np.float32(clamp).view(np.uint32)) + 1
    worst = [0.0, 0.0, 0.0, 0.0, 0.0]
    for start in range(0, end, step):
        x = np.arange(start, min(start + step, end), dtype=np.uint32).view(np.float32)
        ref = erf64(x.astype(np.float64))
        err = np.abs(evaluate_float32(x, a, b).astype(np.float64) - ref)
        i = int(np.argmax(err))
        if err[i] > worst[0]:
            worst[:2] = float(err[i]), float(x[i])
        normal = ref >= 2.0 ** -126
        rel = err[normal] / ref[normal]
        if rel.size and rel.max() > worst[2]:
            worst[2:4] = float(rel.max()), float(x[normal][int(np.argmax(rel))])
        if not normal.all():
            worst[4] = max(worst[4], float(err[~normal].max()) / 2.0 ** -149)
    return tuple(worst)


def main():
    a, b, error = fit()
    a32 = tuple(float(np.float32(v)) for v in a)
    b32 = tuple(float(np.float32(v)) for v in b)
    print(f"degrees {DEG_P}/{DEG_Q} in x^2 on |x| <= {CLAMP}: "
          f"float64 fit relative error {error:.2e}")
    print("_ERF32_P = (" + ", ".join(str(np.float32(v)) for v in a32) + ")")
    print("_ERF32_Q = (" + ", ".join(str(np.float32(v)) for v in b32) + ")")
    rng = np.random.default_rng(0)
    x = np.concatenate([np.linspace(0.0, 4.5, 400_001, dtype=np.float32),
                        rng.uniform(0.0, 4.5, 400_000).astype(np.float32),
                        (10.0 ** rng.uniform(-30, 0.6, 200_000)).astype(np.float32)])
    ref = _erf(x)
    err = np.abs(evaluate_float32(x, a32, b32).astype(np.float64) - ref)
    at_clamp = evaluate_float32(np.float32(CLAMP), a32, b32, clip=False)
    print(f"float32 evaluation: max abs error {err.max():.3g}, "
          f"max rel error {(err[x > 0] / ref[x > 0]).max():.3g}; unclipped value at the clamp "
          f"{at_clamp!r} (>= 1 makes erf(+-inf) exactly +-1)")
    if "--exhaustive" in sys.argv[1:]:
        abs_err, abs_x, rel_err, rel_x, subnormal = exhaustive(a32, b32)
        print(f"every float32 in [0, {CLAMP}]: max abs error {abs_err:.4g} at x = {abs_x!r}, "
              f"max rel error {rel_err:.4g} at x = {rel_x!r}, subnormal results within "
              f"{subnormal:.2f} x 2**-149")


if __name__ == "__main__":
    main()

"""Values of the three FP16 implementations: flushes where MI200 flushes, keeps elsewhere,
and the alternate stays within BF16 precision of a float64 reference."""

import numpy as np
import pytest

from graphopt.executor.numerics import GEMM_RNZ_ENV, BackwardPassGuard, Fp16Policy, Numerics

ALT_EVERYWHERE = Fp16Policy(gemm="alternate", conv="alternate")
ORIG_EVERYWHERE = Fp16Policy(gemm="original", conv="original")


def f16(x):
    return np.asarray(x, dtype=np.float16)


def test_original_mi200_flushes_inputs_and_outputs_bit_exactly():
    numerics = Numerics(mode="mi200", policy=ORIG_EVERYWHERE)
    d = 2.0**-20
    # input flush: subnormal x 1.0 is exactly zero
    np.testing.assert_array_equal(numerics.matmul(f16([[d, -d]]), f16([[1.0], [0.0]])), [[0.0]])
    # output flush: normal x normal = subnormal -> a zero of the same sign
    out = numerics.matmul(f16([[2.0**-8], [-(2.0**-8)]]), f16([[2.0**-8]]))
    assert out.view(np.uint16).tolist() == [[0x0000], [0x8000]]
    # normal results are untouched: 1.5 * 2 + subnormal * 1 (flushed) = 3
    np.testing.assert_array_equal(numerics.matmul(f16([[1.5, d]]), f16([[2.0], [1.0]])), [[3.0]])


def test_native_original_keeps_subnormals():
    numerics = Numerics(mode="native", policy=ORIG_EVERYWHERE)
    d = 2.0**-20
    np.testing.assert_array_equal(numerics.matmul(f16([[d, 1.0]]), f16([[1.0], [0.0]])), [[d]])
    out = numerics.matmul(f16([[-(2.0**-8)]]), f16([[2.0**-8]]))
    assert out[0, 0] == np.float16(-(2.0**-16))


@pytest.mark.parametrize("mode", ["native", "mi200"])
def test_alternate_keeps_denormals_in_both_modes(mode):
    numerics = Numerics(mode=mode, policy=ALT_EVERYWHERE)
    out = numerics.matmul(f16([[2.0**-20, 2.0**-8]]), f16([[1.0], [2.0**-8]]))
    assert out[0, 0] == np.float16(2.0**-20 + 2.0**-16)  # subnormal output kept


@pytest.mark.parametrize("mode", ["native", "mi200"])
def test_alternate_rounding_is_visible_in_both_modes(mode, monkeypatch):
    x = f16([[1 + 5 * 2.0**-10]])  # low mantissa bits 0b101: truncate -> 1, RNZ -> 1 + 2**-7
    one = f16([[1.0]])
    truncating = Numerics(mode=mode, policy=ALT_EVERYWHERE)
    assert truncating.matmul(x, one)[0, 0] == 1.0
    monkeypatch.setenv(GEMM_RNZ_ENV, "1")
    rnz = Numerics(mode=mode, policy=Fp16Policy.from_env())
    with BackwardPassGuard():
        assert rnz.matmul(x, one)[0, 0] == np.float16(1 + 2.0**-7)
        # _RNZ is rocBLAS's variable: convolutions (MIOpen) keep truncation
        assert rnz.matmul(x, one, op="conv_bwd_data")[0, 0] == 1.0
    assert rnz.matmul(x, one)[0, 0] == x[0, 0]  # forward GEMM: original, no BF16 at all


def _denormal_heavy(rng, shape):
    """Magnitudes spread over [2**-24, 2**-6]: about half the values are FP16 subnormals."""
    magnitude = 2.0 ** rng.uniform(-24, -6, size=shape)
    return (magnitude * rng.choice([-1.0, 1.0], size=shape)).astype(np.float16)


@pytest.mark.parametrize("rounding", ["truncate", "rnz"])
def test_alternate_matches_float64_reference_within_bf16_precision(rounding):
    rng = np.random.default_rng(5)
    a = _denormal_heavy(rng, (24, 40))
    b = (rng.standard_normal((40, 16)) * 4).astype(np.float16)
    numerics = Numerics(mode="mi200", policy=Fp16Policy(gemm="alternate", gemm_rounding=rounding))
    got = numerics.matmul(a, b).astype(np.float64)
    exact = a.astype(np.float64) @ b.astype(np.float64)
    # each BF16 input is within 2**-7 (truncate) / 2**-8 (rnz) relative of the FP16 value
    bound = 2.0**-6 * (np.abs(a.astype(np.float64)) @ np.abs(b.astype(np.float64)))
    bound += np.abs(exact) * 2.0**-11 + 2.0**-25  # final FP16 rounding (abs part: subnormals)
    assert np.all(np.abs(got - exact) <= bound)


def test_all_subnormal_operand_vanishes_in_original_but_not_in_alternate():
    rng = np.random.default_rng(3)
    a = (rng.integers(1, 1024, (6, 20)) * rng.choice([-1, 1], (6, 20)) * 2.0**-24)
    a = a.astype(np.float16)  # every value an FP16 subnormal
    b = (2.0 ** rng.integers(0, 11, (20, 7)) * rng.choice([-1, 1], (20, 7))).astype(np.float16)
    exact = a.astype(np.float64) @ b.astype(np.float64)
    original = Numerics(mode="mi200", policy=ORIG_EVERYWHERE).matmul(a, b)
    assert not original.any()  # everything flushed
    alternate = Numerics(mode="mi200", policy=ALT_EVERYWHERE).matmul(a, b).astype(np.float64)
    bound = 2.0**-7 * (np.abs(a.astype(np.float64)) @ np.abs(b.astype(np.float64)))
    assert np.all(np.abs(alternate - exact) <= bound + np.abs(exact) * 2.0**-11 + 2.0**-25)
    assert np.count_nonzero(alternate) > 0.9 * alternate.size


def test_original_mi200_matches_an_independent_flush_reference():
    rng = np.random.default_rng(11)
    a = _denormal_heavy(rng, (8, 32))
    b = _denormal_heavy(rng, (32, 8)) * np.float16(1024)
    a64, b64 = a.astype(np.float64), b.astype(np.float64)
    flush64 = lambda x: np.where(np.abs(x) < 2.0**-14, 0.0, x)  # noqa: E731
    reference = flush64(flush64(a64) @ flush64(b64))
    got = Numerics(mode="mi200", policy=ORIG_EVERYWHERE).matmul(a, b).astype(np.float64)
    assert np.all((got == 0) | (np.abs(got) >= 2.0**-14))  # no subnormal escapes
    close = np.abs(got - reference) <= np.abs(reference) * 2.0**-10 + 2.0**-14
    assert close.all()


@pytest.mark.parametrize("policy", [ALT_EVERYWHERE, ORIG_EVERYWHERE])
@pytest.mark.parametrize(
    "shape_a, shape_b",
    [((3, 4), (4, 5)), ((2, 3, 4), (4, 5)), ((4,), (4, 5)), ((3, 4), (4,)),
     ((2, 1, 3, 4), (5, 4, 2)), ((4,), (4,))],
)
def test_matmul_broadcasting_semantics(policy, shape_a, shape_b):
    rng = np.random.default_rng(0)
    a = rng.uniform(-2, 2, shape_a).astype(np.float16)
    b = rng.uniform(-2, 2, shape_b).astype(np.float16)
    got = Numerics(mode="mi200", policy=policy).matmul(a, b)
    expected = np.matmul(a.astype(np.float64), b.astype(np.float64))
    assert got.dtype == np.float16 and got.shape == expected.shape
    np.testing.assert_allclose(got.astype(np.float64), expected, rtol=2**-6, atol=2**-5)

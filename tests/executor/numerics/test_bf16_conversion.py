"""FP16 -> BF16 truncation and RNZ, checked exhaustively against a pure-Python reference."""

import math
import struct

import ml_dtypes
import numpy as np
import pytest

from graphopt.executor.numerics.fp16_bits import (
    bf16_bits_to_float32,
    count_subnormals,
    flush_subnormals,
    fp16_to_bf16_bits,
)

ALL_FP16 = np.arange(65536, dtype=np.uint32).astype(np.uint16).view(np.float16)


def bf16_bits_value(bits: int) -> float:
    """Decode BF16 bits with struct only (independent of the code under test)."""
    return struct.unpack("<f", struct.pack("<I", int(bits) << 16))[0]


def reference_bf16_value(x: float, rounding: str) -> float:
    """x rounded to 8 significant bits: toward zero, or to nearest with ties toward zero.

    Exact in float64: an FP16 value has at most 11 significant bits and BF16's exponent
    range covers FP16's, so only the significand is rounded.
    """
    if x == 0 or math.isinf(x):
        return x
    fraction, exponent = math.frexp(abs(x))  # |x| = fraction * 2**exponent, 0.5 <= f < 1
    scaled = fraction * 256.0  # in [128, 256): the 8 kept bits are its integer part
    kept = math.floor(scaled)
    if rounding == "rnz" and scaled - kept > 0.5:  # exactly 0.5 stays (ties toward zero)
        kept += 1
    return math.copysign(math.ldexp(kept, exponent - 8), x)


@pytest.mark.parametrize("rounding", ["truncate", "rnz"])
def test_every_fp16_pattern_matches_reference(rounding):
    bits = fp16_to_bf16_bits(ALL_FP16, rounding)
    assert bits.dtype == np.uint16 and bits.shape == (65536,)
    mismatches = []
    for pattern in range(65536):
        x = float(ALL_FP16[pattern])
        got = bf16_bits_value(bits[pattern])
        if math.isnan(x):
            ok = math.isnan(got) and math.copysign(1, got) == math.copysign(1, x)
        else:
            want = reference_bf16_value(x, rounding)
            ok = got == want and math.copysign(1, got) == math.copysign(1, want)
        if not ok:
            mismatches.append((hex(pattern), x, got))
    assert not mismatches, mismatches[:10]


def test_truncation_and_rnz_differ_exactly_above_the_tie():
    """They differ iff the 3 dropped FP16 mantissa bits exceed 0b100 (finite values).

    For FP16 normals the dropped bits are the low 3 mantissa bits. For subnormals the
    significand is shifted left on normalisation, so count from the float32 view instead.
    """
    trunc = fp16_to_bf16_bits(ALL_FP16, "truncate")
    rnz = fp16_to_bf16_bits(ALL_FP16, "rnz")
    dropped = ALL_FP16.astype(np.float32).view(np.uint32) & 0xFFFF
    finite = np.isfinite(ALL_FP16)
    differ = trunc != rnz
    np.testing.assert_array_equal(differ, finite & (dropped > 0x8000))
    # where they differ, RNZ is exactly one BF16 ulp further from zero (carry included)
    np.testing.assert_array_equal(rnz[differ], trunc[differ] + 1)
    # normal FP16 with low bits 0b101..0b111 are the differing ones among normals
    normal = finite & (np.abs(ALL_FP16) >= np.float16(2.0**-14))
    low3 = ALL_FP16.view(np.uint16) & 0x7
    np.testing.assert_array_equal(differ[normal], (low3 > 4)[normal])


def test_tie_cases_round_toward_zero_not_to_even():
    one_ulp16 = 2.0**-10
    values = np.array(
        [1 + 4 * one_ulp16,  # tie, kept bit even: both give 1
         1 + 12 * one_ulp16,  # tie, kept bit odd: RNZ 1+8u (RNE would give 1+16u)
         -(1 + 12 * one_ulp16),
         1 + 5 * one_ulp16,  # above the tie: RNZ rounds up
         65504.0],  # FP16 max: RNZ carries into the exponent (65536 is a BF16 value)
        dtype=np.float16,
    )
    trunc = bf16_bits_to_float32(fp16_to_bf16_bits(values, "truncate"))
    rnz = bf16_bits_to_float32(fp16_to_bf16_bits(values, "rnz"))
    rne = values.astype(ml_dtypes.bfloat16).astype(np.float32)
    np.testing.assert_array_equal(trunc, [1.0, 1 + 8 * one_ulp16, -(1 + 8 * one_ulp16),
                                          1.0, 65280.0])
    np.testing.assert_array_equal(rnz, [1.0, 1 + 8 * one_ulp16, -(1 + 8 * one_ulp16),
                                        1 + 8 * one_ulp16, 65536.0])
    assert rne[1] == 1 + 16 * one_ulp16 != rnz[1]  # ml_dtypes (RNE) is neither mode


def test_subnormals_become_normal_bf16_values():
    smallest = np.array([2.0**-24, -(2.0**-24), 3 * 2.0**-24, 1023 * 2.0**-24], np.float16)
    for rounding in ("truncate", "rnz"):
        got = bf16_bits_to_float32(fp16_to_bf16_bits(smallest, rounding))
        assert np.all(np.abs(got) >= np.float32(2.0**-126))  # normal in BF16
    # 1023 * 2**-24 has 10 significant bits: truncation keeps 8, RNZ rounds 0b11 up
    assert bf16_bits_to_float32(fp16_to_bf16_bits(smallest[3:], "truncate"))[0] == 1020 * 2.0**-24
    assert bf16_bits_to_float32(fp16_to_bf16_bits(smallest[3:], "rnz"))[0] == 1024 * 2.0**-24


def test_nan_payload_in_dropped_bits_stays_nan():
    nan_low_payload = np.array([0x7C01, 0xFC01, 0x7C00, 0xFC00], np.uint16).view(np.float16)
    for rounding in ("truncate", "rnz"):
        got = bf16_bits_to_float32(fp16_to_bf16_bits(nan_low_payload, rounding))
        assert np.isnan(got[:2]).all()
        assert np.signbit(got[1]) and not np.signbit(got[0])
        np.testing.assert_array_equal(got[2:], [np.inf, -np.inf])


def test_flush_keeps_sign_and_normals():
    bits = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    flushed = flush_subnormals(bits.view(np.float16)).view(np.uint16)
    exponent_zero = (bits & 0x7C00) == 0
    np.testing.assert_array_equal(flushed[exponent_zero], bits[exponent_zero] & 0x8000)
    np.testing.assert_array_equal(flushed[~exponent_zero], bits[~exponent_zero])


def test_count_subnormals_all_patterns():
    assert count_subnormals(ALL_FP16) == 2 * 1023
    strided = ALL_FP16.reshape(256, 256)[:, ::2]  # non-contiguous view
    expected = int(np.count_nonzero((np.abs(strided) < 2.0**-14) & (strided != 0)))
    assert count_subnormals(strided) == expected

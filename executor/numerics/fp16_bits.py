"""Bit-level FP16 operations on NumPy arrays: denormal flush/count, FP16->BF16 conversion.

Why bit operations: ml_dtypes' ``astype(bfloat16)`` rounds to nearest-even, which is neither
rocBLAS conversion, and "flush to zero keeping the sign" is simplest on the raw bits.

FP16 layout: sign 0x8000, exponent 0x7C00, mantissa 0x03FF. Exponent field 0 means zero or
subnormal; both flush to a zero of the same sign (MI200 MFMA behaviour).
"""

from __future__ import annotations

import numpy as np

from .policy import RNZ, TRUNCATE

FP16_SIGN = 0x8000
FP16_EXPONENT = 0x7C00
FP16_MANTISSA = 0x03FF


def fp16_bits(a: np.ndarray) -> np.ndarray:
    """The uint16 view of an FP16 array (no copy; works for any strides)."""
    return a.view(np.uint16)


def subnormal_mask(bits: np.ndarray) -> np.ndarray:
    """True where the FP16 bit pattern is a subnormal (nonzero with a zero exponent field).

    One subtract and one compare: |bits| - 1 wraps to 0xFFFF for (signed) zero, so the
    subnormal magnitudes 0x0001..0x03FF are exactly those below 0x03FF after the shift.
    """
    return ((bits & 0x7FFF) - np.uint16(1)) < np.uint16(FP16_MANTISSA)


def count_subnormals(a: np.ndarray) -> int:
    """Number of FP16 subnormal values in ``a``."""
    return int(np.count_nonzero(subnormal_mask(fp16_bits(a))))


def flush_subnormals(a: np.ndarray) -> np.ndarray:
    """A new FP16 array with every subnormal replaced by a zero of the same sign."""
    bits = fp16_bits(a)
    keep = np.where((bits & FP16_EXPONENT) == 0, np.uint16(FP16_SIGN), np.uint16(0xFFFF))
    return (bits & keep).view(np.float16)


def fp16_as_bf16_float32(a: np.ndarray, rounding: str = TRUNCATE) -> np.ndarray:
    """The FP16 values of ``a`` after the alternate path's FP16->BF16 conversion, as float32.

    FP16 -> float32 is exact (subnormals included), so the conversion is rocBLAS's
    float32 -> BF16 one on the float32 bits ``u``, done in place on one float32 copy:
      * truncate: keep the top 16 bits (``u & 0xFFFF0000``);
      * rnz: ``(u + 0x7FFF) & 0xFFFF0000`` -- a discarded half of exactly 0x8000 does not
        carry (ties toward zero, in magnitude since the format is sign-magnitude), anything
        above carries into the kept bits (possibly into the exponent: correct rounding).
    Inf/NaN (exponent all ones) are never rounded; a NaN whose payload sits only in the
    discarded bits gets the lowest kept mantissa bit set so it stays NaN (as rocBLAS does).
    """
    if rounding not in (TRUNCATE, RNZ):
        raise ValueError(f"rounding must be 'truncate' or 'rnz', got {rounding!r}")
    values = np.array(a, dtype=np.float32)  # always a fresh copy we may modify
    u = values.view(np.uint32)
    nan_with_low_payload = None
    if np.isnan(values).any():  # rare; one extra read pass only when NaNs exist
        nan_with_low_payload = np.isnan(values) & ((u & 0xFFFF) != 0)
    if rounding == RNZ:
        finite = (u & 0x7F800000) != 0x7F800000
        np.add(u, np.uint32(0x7FFF), out=u, where=finite)
    np.bitwise_and(u, np.uint32(0xFFFF0000), out=u)
    if nan_with_low_payload is not None:
        u[nan_with_low_payload] |= np.uint32(0x10000)
    return values


def fp16_to_bf16_bits(a: np.ndarray, rounding: str = TRUNCATE) -> np.ndarray:
    """BF16 bit patterns (uint16) of the FP16 values in ``a`` (see fp16_as_bf16_float32)."""
    return (fp16_as_bf16_float32(a, rounding).view(np.uint32) >> 16).astype(np.uint16)


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """Exact float32 values of BF16 bit patterns."""
    return (bits.astype(np.uint32) << 16).view(np.float32)

"""The C integer parsers the ROCm libraries apply to their environment variables.

Reproduced bit for bit because odd values ("", "abc", " 1", "1x", "0x1", "-1",
"4294967296") are exactly where a Python ``int()`` would disagree with the library:

* rocBLAS: ``std::atoi(getenv(name))`` -- glibc implements ``atoi`` as
  ``(int) strtol(s, NULL, 10)``: leading C whitespace, optional sign, decimal digits up
  to the first non-digit, no digits -> 0, clamped to ``long`` then truncated to 32 bits.
* MIOpen (``MIOPEN_DECLARE_ENV_VAR_UINT64``): ``std::strtoull(s, nullptr, 0)`` -- base
  auto-detection ("0x"/"0X" hex, leading "0" octal, else decimal), a leading '-' negates
  modulo 2**64, overflow -> ULLONG_MAX; the value is then ``static_cast<int>``-ed.
"""

from __future__ import annotations

_C_WHITESPACE = " \t\n\v\f\r"  # what C isspace() accepts in the "C" locale
_DIGIT_VALUES = {c: i for i, c in enumerate("0123456789abcdefghijklmnopqrstuvwxyz")}

_LONG_MAX = 2**63 - 1  # LP64 (Linux x86-64 / aarch64), where ROCm runs
_ULLONG_MAX = 2**64 - 1


def _digit(char: str, base: int) -> int | None:
    value = _DIGIT_VALUES.get(char.lower()) if char.isascii() else None
    return value if value is not None and value < base else None


def _scan(text: str, base: int) -> tuple[bool, int]:
    """(negative, magnitude) as strtol/strtoull scan them; magnitude is unbounded."""
    i, n = 0, len(text)
    while i < n and text[i] in _C_WHITESPACE:
        i += 1
    negative = False
    if i < n and text[i] in "+-":
        negative = text[i] == "-"
        i += 1
    if base == 0:
        # "0x" only counts as a prefix when a hex digit follows; otherwise the "0" is the
        # whole number and scanning stops at the 'x'.
        if text[i : i + 2] in ("0x", "0X") and i + 2 < n and _digit(text[i + 2], 16) is not None:
            base, i = 16, i + 2
        elif i < n and text[i] == "0":
            base = 8
        else:
            base = 10
    magnitude = 0
    while i < n and (d := _digit(text[i], base)) is not None:
        magnitude = magnitude * base + d
        i += 1
    return negative, magnitude


def to_c_int(value: int) -> int:
    """Two's-complement truncation to a 32-bit ``int`` (what ``(int)`` does on every ABI ROCm
    supports)."""
    return ((value + 2**31) % 2**32) - 2**31


def c_atoi(text: str) -> int:
    """glibc ``atoi(text)``."""
    negative, magnitude = _scan(text, 10)
    as_long = -min(magnitude, _LONG_MAX + 1) if negative else min(magnitude, _LONG_MAX)
    return to_c_int(as_long)


def c_strtoull(text: str, base: int = 0) -> int:
    """``strtoull(text, NULL, base)`` as an unsigned 64-bit value."""
    negative, magnitude = _scan(text, base)
    if magnitude > _ULLONG_MAX:
        return _ULLONG_MAX  # ERANGE: the sign is ignored
    return (-magnitude) % 2**64 if negative else magnitude


def miopen_int_value(text: str) -> int:
    """What MIOpen's ``env::value_or(<UINT64 var>, int default)`` returns for a set variable."""
    return to_c_int(c_strtoull(text, 0))

import pytest

from graphopt.executor.numerics.c_parsing import c_atoi, c_strtoull, miopen_int_value


@pytest.mark.parametrize(
    "text, value",
    [("", 0), ("abc", 0), ("0", 0), ("1", 1), ("2", 2), ("-1", -1), (" 1", 1), ("\t\n+7", 7),
     ("1x", 1), ("0x1", 0), ("- 1", 0), ("12abc3", 12), ("4294967296", 0),
     ("4294967297", 1), ("2147483648", -(2**31)), ("99999999999999999999", -1), ("１", 0),
     # strtol saturates at LONG_MIN (-2**63), whose low 32 bits are 0: glibc prints 0 0 1
     ("-9223372036854775808", 0), ("-99999999999999999999", 0), ("-9223372036854775807", 1)],
)
def test_c_atoi(text, value):
    assert c_atoi(text) == value


@pytest.mark.parametrize(
    "text, value",
    [("", 0), ("abc", 0), ("1", 1), (" 1", 1), ("1x", 1), ("0x1", 1), ("0X1f", 31),
     ("0x", 0), ("0xg", 0), ("010", 8), ("08", 0), ("-1", 2**64 - 1), ("-0x2", 2**64 - 2),
     ("18446744073709551616", 2**64 - 1), ("-18446744073709551616", 2**64 - 1)],
)
def test_c_strtoull_base0(text, value):
    assert c_strtoull(text) == value


@pytest.mark.parametrize(
    "text, value",
    [("", 0), ("-1", -1), ("2", 2), ("4294967297", 1), ("4294967296", 0), ("0x1", 1)],
)
def test_miopen_int_value(text, value):
    assert miopen_int_value(text) == value

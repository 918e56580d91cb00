import warnings

import pytest

from graphopt.executor.numerics import (
    CONV_ENV,
    GEMM_ENV,
    GEMM_RNZ_ENV,
    Fp16EnvWarning,
    Fp16Policy,
)


def read_policy_warnings(environ):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # so only our own once-per-process logic filters
        Fp16Policy.from_env(environ)
    return [str(w.message) for w in caught if issubclass(w.category, Fp16EnvWarning)]


@pytest.mark.parametrize("name", [GEMM_ENV, GEMM_RNZ_ENV, CONV_ENV])
def test_warns_once_per_variable_and_value(name):
    first = read_policy_warnings({name: "2"})
    assert len(first) == 1
    assert name in first[0] and "'2'" in first[0] and "read as" in first[0]
    assert read_policy_warnings({name: "2"}) == []  # same pair: silent
    assert len(read_policy_warnings({name: " 1"})) == 1  # new value: warns
    assert read_policy_warnings({name: "2"}) == []


@pytest.mark.parametrize("value", ["0", "1"])
def test_plain_values_do_not_warn(value):
    environ = {GEMM_ENV: value, GEMM_RNZ_ENV: value, CONV_ENV: value}
    assert read_policy_warnings(environ) == []


def test_unset_does_not_warn():
    assert read_policy_warnings({}) == []


def test_message_says_how_the_value_was_read():
    gemm = read_policy_warnings({GEMM_ENV: "abc"})
    assert gemm and "C atoi -> 0" in gemm[0] and "original" in gemm[0]
    conv = read_policy_warnings({CONV_ENV: "-1"})
    assert conv and "strtoull(base 0) cast to int -> -1" in conv[0]
    assert "conv fwd original, bwd-data alternate, bwd-weights alternate" in conv[0]
    empty = read_policy_warnings({CONV_ENV: ""})
    assert empty and "''" in empty[0] and "-> 0" in empty[0]

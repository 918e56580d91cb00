"""On ROCm the policy states what rocBLAS will really do: rocBLAS reads
ROCBLAS_INTERNAL_FP16_ALT_IMPL(_RNZ) itself (tensile_host.cpp) and, when set, replaces the
fp16_alt_impl flag of every FP16 GEMM it runs, convolutions lowered to GEMMs included."""

import warnings

import pytest

from graphopt.executor.numerics import (
    ALTERNATE,
    GEMM_ENV,
    GEMM_RNZ_ENV,
    ORIGINAL,
    RNZ,
    TRUNCATE,
    Fp16EnvWarning,
    Fp16Policy,
)

OPS = ("gemm_forward", "gemm_backward", "conv_fwd", "conv_bwd_data", "conv_bwd_weights")


def test_unset_keeps_the_policy():
    policy = Fp16Policy(gemm="original", conv="alternate", gemm_rounding=RNZ)
    assert policy.under_rocblas_env({}) is policy


@pytest.mark.parametrize(("value", "impl"), [("1", ALTERNATE), ("0", ORIGINAL), ("7", ALTERNATE),
                                             ("x", ORIGINAL)])
def test_set_variable_decides_every_gemm_and_lowered_conv(value, impl):
    effective = Fp16Policy().under_rocblas_env({GEMM_ENV: value})
    decisions = effective.decisions()
    assert {decisions[op] for op in OPS} == {impl}
    assert "rocBLAS reads" in effective.describe()


def test_rnz_variable_sets_the_rounding_of_gemm_and_conv():
    effective = Fp16Policy(gemm_rounding=TRUNCATE).under_rocblas_env({GEMM_RNZ_ENV: "1"})
    assert effective.gemm_rounding == effective.conv_rounding == RNZ
    # the implementation choices are untouched by the RNZ variable alone
    assert effective.gemm_forward == ORIGINAL and effective.gemm_backward == ALTERNATE


def test_a_programmatic_policy_overridden_by_the_library_is_reported():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        Fp16Policy(gemm="original").under_rocblas_env({GEMM_ENV: "1"}, warn=True)
        Fp16Policy(gemm="alternate", conv="alternate").under_rocblas_env({GEMM_ENV: "1"},
                                                                         warn=True)
    said = [w for w in caught if issubclass(w.category, Fp16EnvWarning)]
    assert len(said) == 1 and "overrides the requested FP16 policy" in str(said[0].message)

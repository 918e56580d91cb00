"""Every cell of the ORT table (env unset / 1 / 0) and every odd env value, observed through
Numerics.matmul on denormal inputs under emulated MI200: flush = original, kept = alternate."""

import warnings

import numpy as np
import pytest

from graphopt.executor.numerics import (
    ALTERNATE,
    CONV_ENV,
    GEMM_ENV,
    ORIGINAL,
    BackwardPassGuard,
    Fp16Policy,
    Numerics,
)

from .helpers import denormal_probe

ORIG, ALT = ORIGINAL, ALTERNATE
CONV_OPS = ("conv_fwd", "conv_bwd_data", "conv_bwd_weights")


def observed(monkeypatch, name, value):
    """{(op, phase): implementation} for a fresh Numerics built with ``name=value``."""
    if value is not None:
        monkeypatch.setenv(name, value)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        numerics = Numerics(mode="mi200")
    result = {}
    for op in ("gemm",) + CONV_OPS:
        result[(op, "forward")] = denormal_probe(numerics, op)
        with numerics.backward_pass():
            result[(op, "backward")] = denormal_probe(numerics, op, sign=-1.0)
    return result


# GEMM: rocBLAS std::atoi(value) == 0 -> original everywhere, else alternate everywhere.
GEMM_CASES = {
    None: (ORIG, ALT),  # seed table: unset -> forward original, backward alternate
    "1": (ALT, ALT),  # seed table
    "0": (ORIG, ORIG),  # seed table
    "": (ORIG, ORIG),  # atoi("") == 0
    "abc": (ORIG, ORIG),
    "2": (ALT, ALT),
    "-1": (ALT, ALT),  # nonzero
    " 1": (ALT, ALT),  # atoi skips leading whitespace
    "1x": (ALT, ALT),  # atoi stops at the first non-digit
    "0x1": (ORIG, ORIG),  # atoi is base 10: "0" then stop
    "4294967296": (ORIG, ORIG),  # glibc: (int) strtol -> low 32 bits are 0
}


@pytest.mark.parametrize("value", list(GEMM_CASES), ids=repr)
def test_gemm_env(monkeypatch, value):
    forward, backward = GEMM_CASES[value]
    seen = observed(monkeypatch, GEMM_ENV, value)
    assert seen[("gemm", "forward")] == forward
    assert seen[("gemm", "backward")] == backward
    # the GEMM variable never touches convolutions (MIOpen defaults)
    for phase in ("forward", "backward"):
        assert seen[("conv_fwd", phase)] == ORIG
        assert seen[("conv_bwd_data", phase)] == ALT
        assert seen[("conv_bwd_weights", phase)] == ALT


# Conv: MIOpen strtoull(value, 0) cast to int; fwd alternate iff == 1, bwd iff != 0.
CONV_CASES = {
    None: (ORIG, ALT, ALT),  # seed table: unset -> forward original, backward alternate
    "1": (ALT, ALT, ALT),  # seed table
    "0": (ORIG, ORIG, ORIG),  # seed table
    "": (ORIG, ORIG, ORIG),  # strtoull("") == 0
    "abc": (ORIG, ORIG, ORIG),
    "2": (ORIG, ALT, ALT),
    "-1": (ORIG, ALT, ALT),  # ULLONG_MAX -> int -1: the unset behaviour
    " 1": (ALT, ALT, ALT),
    "1x": (ALT, ALT, ALT),
    "0x1": (ALT, ALT, ALT),  # base 0: hex
    "08": (ORIG, ORIG, ORIG),  # base 0: octal "0", stops at '8'
    "4294967297": (ALT, ALT, ALT),  # 2**32 + 1 -> int 1
}


@pytest.mark.parametrize("value", list(CONV_CASES), ids=repr)
def test_conv_env(monkeypatch, value):
    fwd, bwd_data, bwd_weights = CONV_CASES[value]
    seen = observed(monkeypatch, CONV_ENV, value)
    # MIOpen decides by direction; ORT's guard does not reach it.
    for phase in ("forward", "backward"):
        assert seen[("conv_fwd", phase)] == fwd
        assert seen[("conv_bwd_data", phase)] == bwd_data
        assert seen[("conv_bwd_weights", phase)] == bwd_weights
    assert seen[("gemm", "forward")] == ORIG
    assert seen[("gemm", "backward")] == ALT


def test_both_variables_together(monkeypatch):
    monkeypatch.setenv(CONV_ENV, "0")
    seen = observed(monkeypatch, GEMM_ENV, "1")
    assert seen == {
        (op, phase): (ALT if op == "gemm" else ORIG)
        for op in ("gemm",) + CONV_OPS
        for phase in ("forward", "backward")
    }


def test_env_is_read_once_at_construction(monkeypatch):
    numerics = Numerics(mode="mi200")
    monkeypatch.setenv(GEMM_ENV, "1")
    assert denormal_probe(numerics, "gemm") == ORIG  # still the unset behaviour
    assert denormal_probe(Numerics(mode="mi200"), "gemm") == ALT


def test_programmatic_policy_overrides_env(monkeypatch):
    monkeypatch.setenv(GEMM_ENV, "1")
    numerics = Numerics(mode="mi200", policy=Fp16Policy(gemm="original", conv="alternate"))
    with BackwardPassGuard():
        assert denormal_probe(numerics, "gemm") == ORIG
    for op in CONV_OPS:
        assert denormal_probe(numerics, op) == ALT


def test_policy_forms_and_validation():
    assert Fp16Policy() == Fp16Policy(gemm=None, conv=None) == Fp16Policy(gemm="guard")
    p = Fp16Policy(gemm={"forward": ALT, "backward": ORIG}, conv={"bwd_weights": ORIG})
    assert (p.gemm_forward, p.gemm_backward) == (ALT, ORIG)
    assert (p.conv_fwd, p.conv_bwd_data, p.conv_bwd_weights) == (ORIG, ALT, ORIG)
    assert p.implementation("gemm", backward=True) == ORIG
    assert p.implementation("conv_bwd_data", backward=False) == ALT
    assert Fp16Policy(gemm=(ALT, ALT), conv=(ALT, ORIG, ALT)).conv_bwd_data == ORIG
    for bad, why in ((dict(gemm="fast"), "gemm must be 'original' or 'alternate', got 'fast'"),
                     (dict(conv={"fwd": "x"}), "conv fwd must be 'original' or 'alternate'"),
                     (dict(conv={"up": ALT}), r"conv mapping keys are .*got \['up'\]"),
                     (dict(gemm_rounding="rne"), "gemm_rounding must be 'truncate' or 'rnz'")):
        with pytest.raises(ValueError, match=why):
            Fp16Policy(**bad)
    with pytest.raises(AttributeError, match="immutable"):
        p.gemm_forward = ORIG
    with pytest.raises(ValueError, match="unknown GEMM-class op 'attention'"):
        p.implementation("attention", backward=False)


def test_describe_names_variables_and_decisions(monkeypatch):
    monkeypatch.setenv(CONV_ENV, "2")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        text = Numerics(mode="mi200").describe()
    assert "numerics mode: mi200" in text and "emulated" in text
    assert f"{GEMM_ENV} unset" in text
    assert f"{CONV_ENV}='2'" in text
    assert "fwd: original" in text and "bwd-weights: alternate" in text


def test_non_fp16_dtypes_bypass_the_policy():
    numerics = Numerics(mode="mi200", policy=Fp16Policy(gemm="alternate"), collect_stats=True)
    for dtype in (np.float32, np.float64):
        a = np.array([[2.0**-140, 1.0 + 2.0**-20]], dtype=dtype)
        b = np.array([[1.0], [1.0]], dtype=dtype)
        out = numerics.matmul(a, b)
        assert out.dtype == dtype
        np.testing.assert_array_equal(out, np.matmul(a, b))
    mixed = numerics.matmul(np.ones((1, 2), np.float16), np.ones((2, 1), np.float32))
    assert mixed.dtype == np.float32
    assert numerics.denormal_report()["nodes"] == {}


def test_unknown_op_is_rejected():
    with pytest.raises(ValueError, match="unknown GEMM-class op"):
        Numerics(mode="native").matmul(np.ones((1, 1), np.float16), np.ones((1, 1), np.float16),
                                       op="conv")

"""Fp16Policy: which FP16 implementation (original or alternate) each GEMM-class call uses.

Five decisions, mirroring the libraries:

* GEMM (rocBLAS): forward / backward, where "backward" means "inside BackwardPassGuard"
  (ORT passes ``rocblas_gemm_flags_fp16_alt_impl`` while the guard is active).
* Convolution (MIOpen): fwd / bwd-data / bwd-weights. MIOpen decides by convolution
  *direction* (``Gfx90aFp16alt::GetFwd/GetBwd/GetWrW``), not by ORT's guard, so the guard
  does not enter the conv decision.

Environment variables are read exactly once (``Fp16Policy.from_env``), as the libraries
read them once into function-local statics; kernels never look at the environment.

Sources of the parsing rules (read from the libraries, restated in our words):

* rocBLAS ``library/src/tensile_host.cpp``: ``static const int fp16AltImplEnv =
  getenv(NAME) == NULL ? -1 : (std::atoi(value) == 0 ? 0 : 1)``; -1 keeps the caller's flag,
  0 forces original, 1 forces alternate. ``..._RNZ`` is parsed the same way and selects
  round-to-nearest-ties-toward-zero for the FP16->BF16 conversion.
* MIOpen ``src/include/miopen/convolution.hpp``: ``MIOPEN_DECLARE_ENV_VAR_UINT64(
  MIOPEN_DEBUG_CONVOLUTION_ATTRIB_FP16_ALT_IMPL)``; ``Gfx90aFp16alt::Get()`` returns
  ``env::value_or(var, value)`` with the descriptor attribute ``value`` defaulting to -1;
  ``GetFwd() = Get() == 1``, ``GetBwd() = GetWrW() = Get() != 0``. ``src/include/miopen/
  env.hpp`` parses a UINT64 variable with ``std::strtoull(s, nullptr, 0)`` (no validation:
  "" and "abc" give 0), and ``value_or`` casts it to ``int``. So "-1" wraps to ULLONG_MAX,
  then to int -1, i.e. the unset behaviour; "0x1" is hex 1; "08" is octal "0" then stop.
"""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Mapping

from .c_parsing import c_atoi, miopen_int_value

ORIGINAL = "original"
ALTERNATE = "alternate"
IMPLEMENTATIONS = (ORIGINAL, ALTERNATE)

TRUNCATE = "truncate"  # rocBLAS plain alt flag: keep the top 16 bits of the float32
RNZ = "rnz"  # rocBLAS _RNZ: round to nearest, ties toward zero
ROUNDINGS = (TRUNCATE, RNZ)

GEMM_ENV = "ROCBLAS_INTERNAL_FP16_ALT_IMPL"
GEMM_RNZ_ENV = "ROCBLAS_INTERNAL_FP16_ALT_IMPL_RNZ"
CONV_ENV = "MIOPEN_DEBUG_CONVOLUTION_ATTRIB_FP16_ALT_IMPL"

GEMM = "gemm"
CONV_FWD = "conv_fwd"
CONV_BWD_DATA = "conv_bwd_data"
CONV_BWD_WEIGHTS = "conv_bwd_weights"
OPS = (GEMM, CONV_FWD, CONV_BWD_DATA, CONV_BWD_WEIGHTS)


class Fp16EnvWarning(UserWarning):
    """An FP16 env var holds something other than "0" or "1" (the library still accepts it)."""


_warned: set[tuple[str, str]] = set()
_warned_lock = threading.Lock()


def reset_env_warnings() -> None:
    """Forget which (variable, value) pairs were already warned about (tests use this)."""
    with _warned_lock:
        _warned.clear()


def _warn_once(name: str, value: str, how_read: str, meaning: str) -> None:
    if value in ("0", "1"):
        return
    key = (name, value)
    with _warned_lock:
        if key in _warned:
            return
        _warned.add(key)
    warnings.warn(
        f"{name}={value!r} is neither '0' nor '1'; read as {how_read}, which means: {meaning}",
        Fp16EnvWarning,
        stacklevel=4,
    )


def _check_impl(value: str, what: str) -> str:
    if value not in IMPLEMENTATIONS:
        raise ValueError(f"{what} must be 'original' or 'alternate', got {value!r}")
    return value


def _gemm_decisions(gemm) -> tuple[str, str]:
    """(forward, backward) from None | 'guard' | 'original' | 'alternate' | pair | mapping."""
    if gemm is None or gemm == "guard":
        return ORIGINAL, ALTERNATE  # the library default: follow BackwardPassGuard
    if isinstance(gemm, str):
        impl = _check_impl(gemm, "gemm")
        return impl, impl
    if isinstance(gemm, Mapping):
        unknown = set(gemm) - {"forward", "backward"}
        if unknown:
            raise ValueError(f"gemm mapping keys are 'forward'/'backward', got {sorted(unknown)}")
        return (
            _check_impl(gemm.get("forward", ORIGINAL), "gemm forward"),
            _check_impl(gemm.get("backward", ALTERNATE), "gemm backward"),
        )
    forward, backward = gemm
    return _check_impl(forward, "gemm forward"), _check_impl(backward, "gemm backward")


def _conv_decisions(conv) -> tuple[str, str, str]:
    """(fwd, bwd_data, bwd_weights) from None | 'original' | 'alternate' | triple | mapping."""
    if conv is None or conv == "default":
        return ORIGINAL, ALTERNATE, ALTERNATE  # MIOpen's default attribute value (-1)
    if isinstance(conv, str):
        impl = _check_impl(conv, "conv")
        return impl, impl, impl
    if isinstance(conv, Mapping):
        unknown = set(conv) - {"fwd", "bwd_data", "bwd_weights"}
        if unknown:
            raise ValueError(
                f"conv mapping keys are 'fwd'/'bwd_data'/'bwd_weights', got {sorted(unknown)}"
            )
        return (
            _check_impl(conv.get("fwd", ORIGINAL), "conv fwd"),
            _check_impl(conv.get("bwd_data", ALTERNATE), "conv bwd_data"),
            _check_impl(conv.get("bwd_weights", ALTERNATE), "conv bwd_weights"),
        )
    fwd, bwd_data, bwd_weights = conv
    return (
        _check_impl(fwd, "conv fwd"),
        _check_impl(bwd_data, "conv bwd_data"),
        _check_impl(bwd_weights, "conv bwd_weights"),
    )


def _check_rounding(value: str, what: str) -> str:
    if value not in ROUNDINGS:
        raise ValueError(f"{what} must be 'truncate' or 'rnz', got {value!r}")
    return value


class Fp16Policy:
    """Resolved FP16 implementation choices; immutable.

    ``gemm``: None (follow the guard: forward original, backward alternate), "original" or
    "alternate" (everywhere), or {"forward": ..., "backward": ...}.
    ``conv``: None (MIOpen default: fwd original, bwd-data and bwd-weights alternate),
    "original" or "alternate" (all directions), or {"fwd", "bwd_data", "bwd_weights"}.
    ``gemm_rounding`` / ``conv_rounding``: FP16->BF16 conversion of the alternate path,
    "truncate" or "rnz". MIOpen has no RNZ switch (the _RNZ variable is rocBLAS's), so
    conv keeps truncation unless set here.
    """

    __slots__ = (
        "gemm_forward",
        "gemm_backward",
        "conv_fwd",
        "conv_bwd_data",
        "conv_bwd_weights",
        "gemm_rounding",
        "conv_rounding",
        "sources",
    )

    def __init__(
        self,
        gemm=None,
        conv=None,
        *,
        gemm_rounding: str = TRUNCATE,
        conv_rounding: str = TRUNCATE,
        sources: Mapping[str, str] | None = None,
    ):
        set_ = object.__setattr__
        forward, backward = _gemm_decisions(gemm)
        fwd, bwd_data, bwd_weights = _conv_decisions(conv)
        set_(self, "gemm_forward", forward)
        set_(self, "gemm_backward", backward)
        set_(self, "conv_fwd", fwd)
        set_(self, "conv_bwd_data", bwd_data)
        set_(self, "conv_bwd_weights", bwd_weights)
        set_(self, "gemm_rounding", _check_rounding(gemm_rounding, "gemm_rounding"))
        set_(self, "conv_rounding", _check_rounding(conv_rounding, "conv_rounding"))
        default_sources = {"gemm": "programmatic", "conv": "programmatic", "rounding": ""}
        set_(self, "sources", dict(default_sources, **(sources or {})))

    def __setattr__(self, name, value):
        raise AttributeError("Fp16Policy is immutable; build a new one")

    # -- decisions ---------------------------------------------------------------------

    def implementation(self, op: str, backward: bool) -> str:
        """'original' or 'alternate' for one call; ``backward`` only matters for "gemm"."""
        if op == GEMM:
            return self.gemm_backward if backward else self.gemm_forward
        if op == CONV_FWD:
            return self.conv_fwd
        if op == CONV_BWD_DATA:
            return self.conv_bwd_data
        if op == CONV_BWD_WEIGHTS:
            return self.conv_bwd_weights
        raise ValueError(f"unknown GEMM-class op {op!r}; expected one of {OPS}")

    def rounding(self, op: str) -> str:
        return self.gemm_rounding if op == GEMM else self.conv_rounding

    def decisions(self) -> dict[str, str]:
        return {
            "gemm_forward": self.gemm_forward,
            "gemm_backward": self.gemm_backward,
            "conv_fwd": self.conv_fwd,
            "conv_bwd_data": self.conv_bwd_data,
            "conv_bwd_weights": self.conv_bwd_weights,
            "gemm_rounding": self.gemm_rounding,
            "conv_rounding": self.conv_rounding,
        }

    def __eq__(self, other):
        return isinstance(other, Fp16Policy) and self.decisions() == other.decisions()

    def __hash__(self):
        return hash(tuple(self.decisions().items()))

    def __repr__(self):
        inner = ", ".join(f"{k}={v!r}" for k, v in self.decisions().items())
        return f"Fp16Policy({inner})"

    def describe(self) -> str:
        """A small table for the CLI banner."""
        src = self.sources
        lines = [
            "FP16 GEMM/conv policy:",
            f"  GEMM  forward: {self.gemm_forward:<9}  backward: {self.gemm_backward:<9}"
            f"  BF16 conversion: {self.gemm_rounding}",
            f"        ({src['gemm']})",
            f"  Conv  fwd: {self.conv_fwd:<9}  bwd-data: {self.conv_bwd_data:<9}"
            f"  bwd-weights: {self.conv_bwd_weights:<9}  BF16 conversion: {self.conv_rounding}",
            f"        ({src['conv']})",
        ]
        if src.get("rounding"):
            lines.append(f"        ({src['rounding']})")
        return "\n".join(lines)

    def under_rocblas_env(self, environ: Mapping[str, str] | None = None, *,
                          warn: bool = False) -> Fp16Policy:
        """The policy rocBLAS really applies when every FP16 product goes through it.

        rocBLAS (``tensile_host.cpp``) reads ``ROCBLAS_INTERNAL_FP16_ALT_IMPL`` and ``..._RNZ``
        once, and when set they replace the caller's ``rocblas_gemm_flags_fp16_alt_impl``
        (and ``_rnz``) on every FP16 GEMM: both GEMM directions and, since the executor
        lowers convolutions to GEMMs, every convolution direction too. Unset, the caller's
        flags (this policy) stand. ``warn``: say so when this changes a decision.
        """
        env = os.environ if environ is None else environ
        gemm_raw, rnz_raw = env.get(GEMM_ENV), env.get(GEMM_RNZ_ENV)
        if gemm_raw is None and rnz_raw is None:
            return self
        impl = None if gemm_raw is None else (ORIGINAL if c_atoi(gemm_raw) == 0 else ALTERNATE)
        rounding = None if rnz_raw is None else (TRUNCATE if c_atoi(rnz_raw) == 0 else RNZ)
        note = f"rocBLAS reads {GEMM_ENV}={gemm_raw!r}, {GEMM_RNZ_ENV}={rnz_raw!r} itself"
        effective = Fp16Policy(
            gemm=impl or (self.gemm_forward, self.gemm_backward),
            conv=impl or (self.conv_fwd, self.conv_bwd_data, self.conv_bwd_weights),
            gemm_rounding=rounding or self.gemm_rounding,
            conv_rounding=rounding or self.conv_rounding,
            sources={
                "gemm": f"{self.sources['gemm']}; {note}" if impl else self.sources["gemm"],
                "conv": (f"{self.sources['conv']}; {note} (convolutions are GEMMs here)"
                         if impl else self.sources["conv"]),
                "rounding": note if rounding else self.sources.get("rounding", ""),
            },
        )
        if warn and effective != self:
            warnings.warn(
                f"{note}, and it overrides the requested FP16 policy on every FP16 GEMM: "
                f"{self!r} becomes {effective!r}", Fp16EnvWarning, stacklevel=3)
        return effective

    # -- environment -------------------------------------------------------------------

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Fp16Policy:
        """Read the three variables the way rocBLAS and MIOpen do (see the module doc)."""
        env = os.environ if environ is None else environ
        gemm, gemm_source = _gemm_from_env(env.get(GEMM_ENV))
        rounding, rounding_source = _rounding_from_env(env.get(GEMM_RNZ_ENV))
        conv, conv_source = _conv_from_env(env.get(CONV_ENV))
        return cls(
            gemm=gemm,
            conv=conv,
            gemm_rounding=rounding,
            sources={"gemm": gemm_source, "conv": conv_source, "rounding": rounding_source},
        )


def _gemm_from_env(raw: str | None):
    if raw is None:
        return None, f"{GEMM_ENV} unset: follow the backward-pass guard"
    parsed = c_atoi(raw)
    impl = ORIGINAL if parsed == 0 else ALTERNATE
    how = f"C atoi -> {parsed}"
    _warn_once(GEMM_ENV, raw, how, f"FP16 GEMM uses the {impl} implementation everywhere")
    return impl, f"{GEMM_ENV}={raw!r} ({how}): {impl} everywhere"


def _rounding_from_env(raw: str | None):
    if raw is None:
        return TRUNCATE, ""
    parsed = c_atoi(raw)
    rounding = TRUNCATE if parsed == 0 else RNZ
    how = f"C atoi -> {parsed}"
    meaning = (
        "the alternate GEMM rounds FP16->BF16 to nearest, ties toward zero"
        if rounding == RNZ
        else "the alternate GEMM truncates FP16->BF16"
    )
    _warn_once(GEMM_RNZ_ENV, raw, how, meaning)
    return rounding, f"{GEMM_RNZ_ENV}={raw!r} ({how}): GEMM BF16 conversion {rounding}"


def _conv_from_env(raw: str | None):
    if raw is None:
        return None, f"{CONV_ENV} unset: MIOpen defaults"
    value = miopen_int_value(raw)
    decisions = {
        "fwd": ALTERNATE if value == 1 else ORIGINAL,
        "bwd_data": ALTERNATE if value != 0 else ORIGINAL,
        "bwd_weights": ALTERNATE if value != 0 else ORIGINAL,
    }
    how = f"strtoull(base 0) cast to int -> {value}"
    meaning = (
        f"conv fwd {decisions['fwd']}, bwd-data {decisions['bwd_data']}, "
        f"bwd-weights {decisions['bwd_weights']}"
    )
    _warn_once(CONV_ENV, raw, how, meaning)
    return decisions, f"{CONV_ENV}={raw!r} ({how}): {meaning}"

"""Numerics: the object the executor hands every GEMM-class product to.

Per call: FP16 x FP16 only (any other dtype goes straight to ``xp.matmul``); the policy
picks original or alternate from the op and BackwardPassGuard; the mode decides whether
"original" flushes denormals (emulated MI200) or not (native, or real MI200 hardware,
where the BLAS itself flushes).
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import numpy

from . import cpu_gemm
from .device import MODES, device_info_for, is_mi200_hardware, resolve_mode
from .guard import BackwardPassGuard
from .policy import ALTERNATE, OPS, Fp16Policy
from .stats import DenormalCounts, DenormalStats, format_denormal_table


def _kernels_for(xp, native_alternate: bool):
    if getattr(xp, "__name__", "") == "cupy":
        from .gpu_gemm import CupyFp16Gemm  # noqa: PLC0415 - CuPy is optional

        return CupyFp16Gemm(xp, native_alternate=native_alternate)
    return cpu_gemm


class Numerics:
    """FP16 numerics policy for one session.

    ``mode``: "native", "mi200", or None (decide from the device: real gfx90a -> "mi200").
    ``policy``: an :class:`Fp16Policy`; None reads the environment once, here.
    ``xp``: numpy or cupy. ``collect_stats``: count denormals per node (costs one
    reduction per operand and result).
    """

    # matmul() passes every product that is not FP16 x FP16 to xp.matmul untouched, so the
    # GEMM entry point may skip this object for those (executor.gemm)
    fp16_only = True

    def __init__(self, mode=None, policy: Fp16Policy | None = None, xp=numpy, collect_stats=False):
        device_info = device_info_for(xp)
        if mode is None:
            mode = resolve_mode(device_info)
        if mode not in MODES:
            raise ValueError(f"numerics mode must be one of {MODES} or None, got {mode!r}")
        self.mode = mode
        policy = policy if policy is not None else Fp16Policy.from_env()
        if device_info.get("platform") == "rocm":
            # rocBLAS reads ROCBLAS_INTERNAL_FP16_ALT_IMPL(_RNZ) itself and applies it to
            # every FP16 GEMM it runs (lowered convolutions included), over any flag we
            # pass: the policy states what will really run.
            policy = policy.under_rocblas_env(warn=policy.sources.get("gemm") == "programmatic")
        self.policy = policy
        self.xp = xp
        # On a real gfx90a the BLAS flushes by itself ("original" is a plain FP16 GEMM) and
        # has the alternate itself (rocBLAS's fp16_alt_impl flag).
        self.hardware_flushes = mode == "mi200" and is_mi200_hardware(device_info)
        self.emulates_flush = mode == "mi200" and not self.hardware_flushes
        self.current_node: str | None = None
        self._kernels = _kernels_for(xp, native_alternate=is_mi200_hardware(device_info))
        self._stats = DenormalStats() if collect_stats else None

    def cache_weights(self, generation) -> bool:
        """Convert the weights of ``generation`` (a ``gpu_gemm.WeightGeneration`` the trainer
        bumps) for the emulated alternate once per generation; False where nothing is
        converted (the CPU kernels, rocBLAS's own alternate)."""
        cache_weights = getattr(self._kernels, "cache_weights", None)
        return bool(cache_weights is not None and cache_weights(generation))

    def backward_pass(self) -> AbstractContextManager:
        """Context manager for nodes carrying ``__backwardpass=1``."""
        return BackwardPassGuard()

    def implementation_for(self, op: str) -> str:
        """What the next ``matmul(..., op=op)`` would use in the current guard state."""
        return self.policy.implementation(op, BackwardPassGuard.is_backward_pass())

    def matmul(self, a, b, op: str = "gemm"):
        if op not in OPS:
            raise ValueError(f"unknown GEMM-class op {op!r}; expected one of {OPS}")
        xp = self.xp
        if a.dtype != xp.float16 or b.dtype != xp.float16:
            if a.ndim > 2 and b.ndim == 2 and a.flags.c_contiguous:
                # one large GEMM, not a batched one per leading index (CuPy would build
                # pointer arrays for a broadcast sgemmBatched)
                flat = xp.matmul(a.reshape(-1, a.shape[-1]), b)
                return flat.reshape(a.shape[:-1] + (b.shape[1],))
            return xp.matmul(a, b)
        backward = BackwardPassGuard.is_backward_pass()
        impl = self.policy.implementation(op, backward)
        counting = self._stats is not None
        kernels = self._kernels
        if impl == ALTERNATE:
            out, output_subnormals = kernels.alternate(a, b, self.policy.rounding(op), counting)
            returned_subnormals = output_subnormals
        elif self.emulates_flush:
            out, output_subnormals = kernels.original_mi200(a, b, counting)
            returned_subnormals = 0
        else:
            out, output_subnormals = kernels.original_native(a, b, counting)
            returned_subnormals = output_subnormals
            if self.hardware_flushes:  # the hardware already flushed; pre-flush is unseen
                output_subnormals = 0
        if counting:
            self._record(a, b, out, backward, impl, output_subnormals, returned_subnormals)
        return out

    def _record(self, a, b, out, backward, impl, output_subnormals, returned_subnormals):
        inputs = self._kernels.count_subnormals(a) + self._kernels.count_subnormals(b)
        call = DenormalCounts(
            calls=1,
            original_calls=int(impl != ALTERNATE),
            alternate_calls=int(impl == ALTERNATE),
            input_values=int(a.size + b.size),
            output_values=int(out.size),
            input_denormals=inputs,
            output_denormals=int(returned_subnormals),
            mi200_flushes=inputs + int(output_subnormals),
        )
        self._stats.record(self.current_node, backward, call)

    # -- reporting ---------------------------------------------------------------------------

    def denormal_report(self) -> dict:
        """JSON-able per-node counts split forward/backward (see ``stats``), plus context."""
        if self._stats is None:
            raise RuntimeError("denormal statistics are off; "
                               "construct Numerics(collect_stats=True)")
        report = self._stats.report()
        report["mode"] = self.mode
        report["flush"] = (
            "hardware" if self.hardware_flushes else "emulated" if self.emulates_flush else "none"
        )
        report["policy"] = self.policy.decisions()
        return report

    def format_denormal_table(self, top: int = 10) -> str:
        return format_denormal_table(self.denormal_report(), top=top)

    def describe(self) -> str:
        """Banner for the CLI: the mode and the policy table."""
        if self.hardware_flushes:
            flush = "MI200 hardware flushes FP16 denormals in the original GEMM/conv"
        elif self.emulates_flush:
            flush = "MI200 emulated: FP16 denormals flushed in the original GEMM/conv"
        else:
            flush = "FP16 denormals kept by the original GEMM/conv"
        return f"numerics mode: {self.mode} ({flush})\n{self.policy.describe()}"

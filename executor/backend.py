"""Array-module selection: numpy on the host, CuPy on a CUDA or ROCm device.

CuPy is imported lazily so that the executor works without it installed.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Any

import numpy as np

from .errors import (
    CupyNotInstalledError,
    DeviceUnavailableError,
    NoGpuDeviceError,
    WrongGpuPlatformError,
)

DEVICES = ("auto", "cpu", "cuda", "rocm")


@dataclass(frozen=True)
class ArrayBackend:
    """The array module kernels are written against, plus host<->device transfers."""

    device: str  # "cpu", "cuda" or "rocm"
    xp: Any

    @property
    def is_gpu(self) -> bool:
        return self.device != "cpu"

    def to_device(self, array: Any) -> Any:
        if self.is_gpu:
            return self.xp.asarray(array)
        return np.asarray(array)

    def to_host(self, array: Any) -> np.ndarray:
        if self.is_gpu and hasattr(array, "get"):
            return array.get()
        return np.asarray(array)


class GpuFallbackWarning(UserWarning):
    """device="auto" found CuPy but could not use a GPU, and runs on NumPy."""


_fallback_warned = False


def _warn_fallback_once(reason: str) -> None:
    global _fallback_warned  # noqa: PLW0603 - one message per process, as promised
    if _fallback_warned:
        return
    _fallback_warned = True
    warnings.warn(f"device='auto': {reason}; running on the CPU (NumPy)",
                  GpuFallbackWarning, stacklevel=4)


def _import_cupy():
    try:
        import cupy  # noqa: PLC0415
    except ImportError as exc:  # also covers a CuPy wheel whose CUDA/ROCm libraries are missing
        raise CupyNotInstalledError(
            f"CuPy is not installed or cannot be imported ({type(exc).__name__}: {exc}); "
            "install graphopt[cuda] (NVIDIA) or graphopt[rocm] (AMD, ROCm 7; see the "
            "README for ROCm 6), or use device='cpu'"
        ) from exc
    return cupy


def _cupy_installed() -> bool:
    import importlib.util  # noqa: PLC0415

    return importlib.util.find_spec("cupy") is not None


def _gpu_count(cupy) -> int:
    try:
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # the runtime raises its own error types when no driver is present
        return 0


def _gpu_error(cupy) -> str:
    try:
        cupy.cuda.runtime.getDeviceCount()
    except Exception as exc:  # noqa: BLE001 - only its text is reported
        return f"{type(exc).__name__}: {exc}"
    return "device count 0"


def _is_hip(cupy) -> bool:
    return bool(getattr(cupy.cuda.runtime, "is_hip", False))


def select_backend(device: str | ArrayBackend = "auto") -> ArrayBackend:
    """Resolve a device name to an ArrayBackend, or raise a DeviceUnavailableError saying why.

    An ArrayBackend is returned as it is (tests run the kernels against a recording array
    module this way). ``"auto"`` stays silent when CuPy is simply not installed; when CuPy
    is installed but unusable (import failure, no device) it warns once and uses NumPy.
    """
    if isinstance(device, ArrayBackend):
        return device
    if device not in DEVICES:
        raise DeviceUnavailableError(f"unknown device {device!r}; expected one of {DEVICES}")
    if device == "cpu":
        return ArrayBackend("cpu", np)
    if device == "auto":
        if not _cupy_installed():
            return ArrayBackend("cpu", np)
        try:
            cupy = _import_cupy()
        except CupyNotInstalledError as exc:
            _warn_fallback_once(str(exc.__cause__ or exc))
            return ArrayBackend("cpu", np)
        if _gpu_count(cupy) == 0:
            _warn_fallback_once(f"CuPy imports but sees no GPU ({_gpu_error(cupy)})")
            return ArrayBackend("cpu", np)
        return ArrayBackend("rocm" if _is_hip(cupy) else "cuda", cupy)

    cupy = _import_cupy()
    if _gpu_count(cupy) == 0:
        raise NoGpuDeviceError(
            f"device={device!r} requested but CuPy sees no GPU device ({_gpu_error(cupy)})")
    built_for = "rocm" if _is_hip(cupy) else "cuda"
    if built_for != device:
        raise WrongGpuPlatformError(
            f"device={device!r} requested but the installed CuPy is a {built_for.upper()} build"
        )
    return ArrayBackend(device, cupy)

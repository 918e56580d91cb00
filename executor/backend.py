"""Array-module selection: numpy on the host, CuPy on a CUDA or ROCm device.

CuPy is imported lazily so that the executor works without it installed.
"""

from __future__ import annotations

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


def _import_cupy():
    try:
        import cupy  # noqa: PLC0415
    except ImportError as exc:  # also covers a CuPy wheel whose CUDA/ROCm libraries are missing
        raise CupyNotInstalledError(
            f"CuPy is not installed or cannot be imported ({exc}); install cupy-cuda12x "
            "(NVIDIA) or cupy-rocm-* (AMD), or use device='cpu'"
        ) from exc
    return cupy


def _gpu_count(cupy) -> int:
    try:
        return int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # the runtime raises its own error types when no driver is present
        return 0


def _is_hip(cupy) -> bool:
    return bool(getattr(cupy.cuda.runtime, "is_hip", False))


def select_backend(device: str = "auto") -> ArrayBackend:
    """Resolve a device name to an ArrayBackend, or raise a DeviceUnavailableError saying why."""
    if device not in DEVICES:
        raise DeviceUnavailableError(f"unknown device {device!r}; expected one of {DEVICES}")
    if device == "cpu":
        return ArrayBackend("cpu", np)
    if device == "auto":
        try:
            cupy = _import_cupy()
        except CupyNotInstalledError:
            return ArrayBackend("cpu", np)
        if _gpu_count(cupy) == 0:
            return ArrayBackend("cpu", np)
        return ArrayBackend("rocm" if _is_hip(cupy) else "cuda", cupy)

    cupy = _import_cupy()
    if _gpu_count(cupy) == 0:
        raise NoGpuDeviceError(f"device={device!r} requested but CuPy sees no GPU device")
    built_for = "rocm" if _is_hip(cupy) else "cuda"
    if built_for != device:
        raise WrongGpuPlatformError(
            f"device={device!r} requested but the installed CuPy is a {built_for.upper()} build"
        )
    return ArrayBackend(device, cupy)

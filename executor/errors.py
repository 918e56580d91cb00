"""Exceptions raised by the executor. Every failure the user can cause is an ExecutorError."""

from __future__ import annotations

from graphopt.vocabulary import domain_label


class ExecutorError(Exception):
    """Base class of all executor errors."""


class DeviceUnavailableError(ExecutorError):
    """The requested device (cuda / rocm) cannot be used on this machine."""


class CupyNotInstalledError(DeviceUnavailableError):
    """A GPU device was requested but CuPy is not importable."""


class NoGpuDeviceError(DeviceUnavailableError):
    """CuPy is installed but sees no GPU device."""


class WrongGpuPlatformError(DeviceUnavailableError):
    """CuPy is built for CUDA while ROCm was requested, or the reverse."""


class UnsupportedOpsError(ExecutorError):
    """The model contains op types with no registered kernel (all listed at once)."""

    def __init__(self, missing: list[tuple[str, str, str, int]]):
        # missing: (node name, domain, op_type, opset version)
        self.missing = missing
        lines = [
            f"  - node {name!r}: {domain_label(domain)}::{op_type} (opset {opset})"
            for name, domain, op_type, opset in missing
        ]
        super().__init__(
            f"{len(missing)} node(s) use op types this executor does not support:\n"
            + "\n".join(lines)
        )


class InvalidModelError(ExecutorError):
    """The graph itself cannot be planned (cycle, undefined tensor, ...)."""


class FeedError(ExecutorError):
    """Feeds do not match the graph inputs (unknown, missing, wrong dtype or shape)."""


class KernelError(ExecutorError):
    """A kernel failed while running a node; the message names the node."""

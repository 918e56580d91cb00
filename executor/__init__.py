"""Reference ONNX executor (inference and ONNX Runtime training graphs) on NumPy or CuPy."""
from graphopt.layout import refuse_second_name

refuse_second_name(__name__, "executor")

from .errors import (
    CupyNotInstalledError,
    DeviceUnavailableError,
    ExecutorError,
    FeedError,
    InvalidModelError,
    KernelError,
    NoGpuDeviceError,
    UnsupportedOpsError,
    WrongGpuPlatformError,
)
from .kernels._compiled import describe as describe_compiled_kernels
from .registry import supported_ops_markdown
from .session import Session

__all__ = [
    "CupyNotInstalledError",
    "DeviceUnavailableError",
    "ExecutorError",
    "FeedError",
    "InvalidModelError",
    "KernelError",
    "NoGpuDeviceError",
    "Session",
    "UnsupportedOpsError",
    "WrongGpuPlatformError",
    "describe_compiled_kernels",
    "supported_ops_markdown",
]

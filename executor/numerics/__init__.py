"""FP16 numerics policy: MI200 denormal flushing and the BF16 alternate GEMM/conv.

Modules:
  guard      BackwardPassGuard (thread-local, nesting-safe)
  c_parsing  the C integer parsers rocBLAS (atoi) and MIOpen (strtoull) apply to env vars
  policy     Fp16Policy: original|alternate per GEMM direction and conv direction
  fp16_bits  NumPy bit operations: flush/count subnormals, FP16->BF16 truncate/RNZ
  cpu_gemm   NumPy implementations; gpu_gemm the CuPy ones (BF16 gemmEx)
  stats      per-node denormal counts and their text table
  device     resolve_mode: real gfx90a -> "mi200", else "native"
  dispatch   Numerics, the object the executor calls
"""

from .device import device_info_for, resolve_mode
from .dispatch import Numerics
from .gpu_gemm import WeightGeneration
from .guard import BackwardPassGuard
from .policy import (
    ALTERNATE,
    CONV_ENV,
    GEMM_ENV,
    GEMM_RNZ_ENV,
    ORIGINAL,
    RNZ,
    TRUNCATE,
    Fp16EnvWarning,
    Fp16Policy,
    reset_env_warnings,
)
from .stats import format_denormal_table

__all__ = [
    "ALTERNATE",
    "CONV_ENV",
    "GEMM_ENV",
    "GEMM_RNZ_ENV",
    "ORIGINAL",
    "RNZ",
    "TRUNCATE",
    "BackwardPassGuard",
    "Fp16EnvWarning",
    "WeightGeneration",
    "Fp16Policy",
    "Numerics",
    "device_info_for",
    "format_denormal_table",
    "reset_env_warnings",
    "resolve_mode",
]

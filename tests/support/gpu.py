"""The GPU tests' one gate: CuPy imported and a CUDA/ROCm device it can reach, else a skip."""

import pytest


def cupy_with_a_device():
    """The ``cupy`` module, or skip the calling test: CuPy not installed, no device, or no
    driver (CuPy then raises its own runtime error types)."""
    cupy = pytest.importorskip("cupy", reason="CuPy is not installed")
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            pytest.skip("CuPy found no CUDA/ROCm device")
    except Exception as exc:  # noqa: BLE001 - no driver
        pytest.skip(f"CuPy cannot reach a device: {exc}")
    return cupy

"""device="auto" without a usable GPU: NumPy, said once when CuPy is installed; asking for
a GPU by name is one clear error naming why it cannot be used."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from graphopt.executor.errors import DeviceUnavailableError

PROBE = """
import warnings
warnings.simplefilter("always")
from graphopt.executor.backend import GpuFallbackWarning, select_backend
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    devices = [select_backend("auto").device for _ in range(3)]
said = [str(w.message) for w in caught if issubclass(w.category, GpuFallbackWarning)]
print(devices[0], len(said))
for line in said:
    print(line)
"""


def _probe():
    done = subprocess.run([sys.executable, "-P", "-c", PROBE], capture_output=True, text=True,
                          timeout=120, check=True)
    first, *messages = done.stdout.strip().splitlines()
    device, count = first.split()
    return device, int(count), messages


def test_auto_without_cupy_is_silent_and_with_unusable_cupy_says_so_once():
    device, count, messages = _probe()
    if device != "cpu":
        pytest.skip("a GPU is usable here")
    if importlib.util.find_spec("cupy") is None:
        assert count == 0  # the plain CPU install: nothing to say
    else:
        assert count == 1, messages  # three selections, one message
        assert "running on the CPU" in messages[0]
        assert "CuPy" in messages[0] or "Error" in messages[0]


def test_named_gpu_without_one_is_one_error_naming_the_cause():
    from graphopt.executor.backend import select_backend

    for device in ("cuda", "rocm"):
        try:
            backend = select_backend(device)
        except DeviceUnavailableError as exc:
            message = str(exc)
            assert "\n" not in message
            assert device in message or "CuPy" in message
            if importlib.util.find_spec("cupy") is not None:
                # the runtime's own reason (driver, library, platform), not a bare "no GPU"
                assert "(" in message
        else:
            assert backend.device == device

import numpy as np
import pytest

from graphopt.executor.numerics import Numerics, device_info_for, resolve_mode


@pytest.mark.parametrize(
    "info, mode",
    [({"platform": "rocm", "arch": "gfx90a:sramecc+:xnack-"}, "mi200"),
     ({"platform": "rocm", "arch": "gfx90a"}, "mi200"),
     ({"platform": "rocm", "arch": "gfx942:sramecc+:xnack-"}, "native"),  # MI300
     ({"platform": "rocm", "arch": "gfx908"}, "native"),  # MI100
     ({"platform": "cuda", "arch": "sm_90"}, "native"),
     ({"platform": "cpu", "arch": None}, "native"),
     (None, "native")],
)
def test_resolve_mode(info, mode):
    assert resolve_mode(info) == mode


def test_cpu_defaults_to_native_and_mi200_is_emulated():
    assert device_info_for(np) == {"platform": "cpu", "arch": None}
    assert Numerics(mode=None).mode == "native"
    emulated = Numerics(mode="mi200")
    assert emulated.emulates_flush and not emulated.hardware_flushes
    with pytest.raises(ValueError, match="numerics mode must be one of .* got 'mi300'"):
        Numerics(mode="mi300")

"""Which numerics mode a device calls for.

"mi200" only comes from the hardware itself: a ROCm device whose architecture is gfx90a
(MI200 series: MI210/MI250/MI250X), where the FP16 MFMA instructions really flush
denormals. Everywhere else the default is "native"; "mi200" can still be requested
explicitly, and is then emulated.
"""

from __future__ import annotations

from collections.abc import Mapping

MI200_ARCH = "gfx90a"
MODES = ("native", "mi200")


def resolve_mode(device_info: Mapping | None) -> str:
    """"mi200" for a real ROCm gfx90a device, else "native".

    ``device_info``: ``{"platform": "cpu"|"cuda"|"rocm", "arch": str|None}`` as
    :func:`device_info_for` builds it. The arch may carry target features
    ("gfx90a:sramecc+:xnack-"), which are ignored.
    """
    if is_mi200_hardware(device_info):
        return "mi200"
    return "native"


def is_mi200_hardware(device_info: Mapping | None) -> bool:
    if not device_info or device_info.get("platform") != "rocm":
        return False
    arch = device_info.get("arch") or ""
    return arch.split(":")[0].strip().lower() == MI200_ARCH


def device_info_for(xp) -> dict:
    """Describe the current device of array module ``xp`` (numpy or cupy)."""
    if getattr(xp, "__name__", "") != "cupy":
        return {"platform": "cpu", "arch": None}
    runtime = xp.cuda.runtime
    properties = runtime.getDeviceProperties(xp.cuda.Device().id)
    if runtime.is_hip:
        arch = properties.get("gcnArchName", b"")
        if isinstance(arch, bytes):
            arch = arch.decode(errors="replace")
        return {"platform": "rocm", "arch": arch}
    return {"platform": "cuda", "arch": f"sm_{properties['major']}{properties['minor']}"}

"""Compiled float32 kernels for the NumPy backend's row and activation passes.

NumPy computes a softmax, a LayerNorm or a GELU as a sequence of whole-array passes, and its
float32 ``exp`` is not vectorised for AVX2 in the wheels this project measures (about 3 ns an
element, like ``tanh``). Over short rows every pass also pays NumPy's per-row cost. The
kernels in ``_jit_kernels`` (numba, compiled once and cached on disk) make one pass per row
with a vectorised ``exp``: an 8.4M-element softmax takes 8-11 ms on two cores instead of
21-28 ms. They release the GIL, so the row blocks of ``_threads`` still share the cores.

``compiled_kernels(xp, dtype, size)`` is the one question the kernel families ask: it returns
the compiled module for NumPy float32 arrays of at least MIN_ELEMENTS elements, or None, and
then the NumPy passes run as before. None also when numba cannot be imported (a Python or
platform without its wheels) or when the environment sets ``GRAPHOPT_COMPILED_KERNELS=0``
(to compare the two paths, or to avoid numba's one-off compile on a machine where its cache
cannot be written). Both paths give the same results within float32 rounding; the tests run
every kernel both ways.
"""

from __future__ import annotations

import os

import numpy as np

ENV_SWITCH = "GRAPHOPT_COMPILED_KERNELS"
# below this many elements the NumPy passes run: they take tens of microseconds (a softmax of
# 1024 float32: 68 us, compiled 36 us), not worth numba's 0.8 s load in a process that has
# not loaded it (kernels called outside a session); a session loads it at set-up anyway
MIN_ELEMENTS = 1 << 12

# the operators whose float32 kernels call the compiled ones
OP_TYPES = frozenset({
    "Softmax", "LogSoftmax", "LayerNormalization", "Gelu", "BiasGelu", "SoftmaxGrad",
    "SoftmaxGrad_13", "LayerNormalizationGrad", "GeluGrad", "BiasGeluGrad_dX",
    "SoftmaxCrossEntropyLoss", "SoftmaxCrossEntropyLossInternal",
    "SoftmaxCrossEntropyLossGrad", "SoftmaxCrossEntropyLossInternalGrad",
    "FastGelu", "FastGeluGrad", "BiasFastGeluGrad_dX",
    # an embedding's gradient: its float32 scatter-add (other scatter-adds use the compiled
    # loop only where something else has loaded it: see loaded_kernels)
    "GatherGrad"})

_module = None
_unavailable: str | None = None


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "off", "false", "no")


def compiled_kernels(xp, dtype, size: int):
    """The compiled kernels for a NumPy ``dtype`` array of ``size`` elements, or None."""
    if xp is not np or dtype != np.float32 or size < MIN_ELEMENTS or not enabled():
        return None
    return _load()


def loaded_kernels(xp, dtype, size: int):
    """As ``compiled_kernels``, but None unless numba's kernels are loaded already: for a
    kernel whose two paths give the same bits and that is not worth numba's load (a
    ScatterND with ``reduction="add"`` in a graph that loads nothing else)."""
    if _module is None:
        return None
    return compiled_kernels(xp, dtype, size)


def preload(op_types) -> None:
    """Load the compiled kernels now if a graph of ``op_types`` may call them: numba's import
    and the start of its code generator take about 0.8 s and 110 MiB, once per process
    (measured here: 0.25-0.4 s and 58 MiB to import, 0.55-0.7 s and 56 MiB for the first
    kernel loaded from numba's cache; the others then take milliseconds). A session's set-up
    pays it, like a framework's import, and not its first run."""
    if enabled() and not OP_TYPES.isdisjoint(op_types):
        _load()


def _load():
    global _module, _unavailable
    if _module is None and _unavailable is None:
        try:
            from . import _jit_kernels  # noqa: PLC0415 - imports numba: only when first needed

            # compiles (or loads) one kernel: a numba that cannot compile here is found now,
            # once, as is one with nowhere to keep its cache (cache=True then fails at import)
            _jit_kernels.warm_up()
        except ImportError as error:  # numba missing or broken: the NumPy passes
            _unavailable = f"numba could not be imported ({error})"
        except Exception as error:  # noqa: BLE001 - any other failure: the NumPy passes too
            _unavailable = f"numba could not compile here ({type(error).__name__}: {error})"
        else:
            _module = _jit_kernels
    return _module


def describe() -> str:
    """What the float32 row and activation kernels run on, for reports."""
    if not enabled():
        return f"NumPy passes ({ENV_SWITCH}=0)"
    module = _load()
    if module is None:
        return f"NumPy passes: {_unavailable}"
    return f"compiled (numba {module.numba_version()})"

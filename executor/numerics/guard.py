"""BackwardPassGuard: the thread-local "are we in the backward pass?" flag.

ONNX Runtime's ROCm EP wraps every node carrying ``__backwardpass=1`` in a
``BackwardPassGuard`` and rocBLAS calls ask ``BackwardPassGuard::is_backward_pass()`` to
decide whether to pass ``rocblas_gemm_flags_fp16_alt_impl``. ORT's guard is thread-local
but not nesting-safe: its destructor sets the flag to false, so leaving an inner guard
silently ends the outer backward region. Ours saves the previous state on entry and
restores it on exit, so guards nest (and a guard object can be re-entered).
"""

from __future__ import annotations

import threading

_state = threading.local()  # each thread starts outside the backward pass


def _current() -> bool:
    return getattr(_state, "backward", False)


class BackwardPassGuard:
    """Context manager marking the code it wraps as backward pass (for this thread only).

    ``BackwardPassGuard(active=False)`` marks a forward region inside a backward one
    (e.g. a recomputed forward node); leaving it restores the backward state.
    """

    __slots__ = ("_active", "_saved")

    def __init__(self, active: bool = True):
        self._active = bool(active)
        self._saved: list[bool] = []  # a stack, so the same guard object may be re-entered

    def __enter__(self) -> BackwardPassGuard:
        self._saved.append(_current())
        _state.backward = self._active
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        _state.backward = self._saved.pop()

    @staticmethod
    def is_backward_pass() -> bool:
        """True while the calling thread is inside an active guard."""
        return _current()

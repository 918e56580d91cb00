"""One BLAS thread for small products (issue 15).

OpenBLAS threads every GEMM above a tiny size (64x64x64). For the mid-size products of a
small training step (a few MFLOP) the second thread saves microseconds at best and costs a
hand-over at every call; on a shared machine, where the other core is often busy, each call
then waits for a worker thread the scheduler has not run yet (measured on a 2-core machine
under load: the `--example mqa` training step 227 ms with two BLAS threads, 35 ms with one).
So a product below SERIAL_FLOPS runs on one BLAS thread; larger ones keep BLAS's own count.

The count is switched through threadpoolctl (the library scikit-learn uses for the same
purpose) and restored right after the product, so code outside the executor never sees it.
Without threadpoolctl, or without a BLAS it can control, products run as they always did.
"""

from __future__ import annotations

import contextlib

import numpy as np

SERIAL_FLOPS = 1 << 26  # 2*M*N*K of one GEMM call below this: one BLAS thread (~1 ms)

_controllers: list | None = None


def _blas_controllers() -> list:
    global _controllers  # noqa: PLW0603 - found once per process
    if _controllers is None:
        try:
            from threadpoolctl import ThreadpoolController  # noqa: PLC0415
        except ImportError:
            _controllers = []
        else:
            _controllers = [c for c in ThreadpoolController().lib_controllers
                            if c.user_api == "blas"]
    return _controllers


@contextlib.contextmanager
def one_thread():
    """BLAS on one thread inside, its previous count restored after."""
    previous = []
    for controller in _blas_controllers():
        count = controller.get_num_threads()
        if count is not None and count > 1:
            controller.set_num_threads(1)
            previous.append((controller, count))
    try:
        yield
    finally:
        for controller, count in previous:
            controller.set_num_threads(count)


def matmul(xp, a, b):
    """``xp.matmul(a, b)``, on one BLAS thread when each GEMM call BLAS sees (the product of
    the last two axes: NumPy loops over the leading ones) is below SERIAL_FLOPS."""
    if xp is not np or a.ndim < 2 or b.ndim < 2:
        return xp.matmul(a, b)
    if 2 * a.shape[-2] * a.shape[-1] * b.shape[-1] >= SERIAL_FLOPS or not _blas_controllers():
        return _numpy_matmul(a, b)
    with one_thread():
        return _numpy_matmul(a, b)


_numpy_matmul = np.matmul  # a name of this module, so a test can watch the calls

"""One BLAS thread for small products.

OpenBLAS threads every GEMM above a tiny size (64x64x64). For the mid-size products of a
small training step (a few MFLOP) the second thread saves microseconds at best and costs a
hand-over at every call; on a shared machine, where the other core is often busy, each call
then waits for a worker thread the scheduler has not run yet (measured on a 2-core machine
under load: the `--example mqa` training step 227 ms with two BLAS threads, 35 ms with one).
So a product below SERIAL_FLOPS runs on one BLAS thread; larger ones keep BLAS's own count.

The count is switched through threadpoolctl (the library scikit-learn uses for the same
purpose). Switching it costs two calls into threadpoolctl per switch, and a training step
makes some twenty small products in a row; so within one ``Session.run`` the count is
switched lazily (``BlasThreads``, owned by the session's kernel context): lowered before
the first small product, left there for the small products that follow, raised back only
before a large product, before a caller's hook runs, and when the run ends (also when a
kernel raises), so code outside the executor never sees the changed count. A product made
outside a run (``plain_matmul`` called directly) switches and restores around itself.
Without threadpoolctl, or without a BLAS it can control, products run as they always did.

Mid-size products (MID_FLOPS to SERIAL_FLOPS: the projections of a small model's training
step) gain from BLAS's threads on a quiet machine (on 2 cores the `--example mqa` training
step was 12-15% faster with every product threaded, about 5% with this adaptation) and lose
badly on a busy one (with a CPU hog beside it, 1.9x as slow with every product threaded).
And a quiet machine does not always gain either: threaded, half of a small product's result
is written from the other core's cache, where its worker then spins, and the kernels that
follow pay for that.
On a 2-core AVX-512 machine the `--example mqa` step's products took 0.99 ms threaded against
1.14 on one thread, yet the step 2.58 ms against 2.43: the kernels after them (LayerNorm's
gradient, Sum, the GELU and its gradient) took 0.28 ms more. So within a session mid-size
products adapt by whole runs: the runs of one plan and feed shapes first make their mid-size
products on one thread SAMPLES times, then on BLAS's threads SAMPLES times, and from then on
the way whose fastest run was faster (the times keep being taken). When two threaded
products of one run take STALL_FACTOR times their shape's best serial time (BLAS's worker
was not running), mid-size products go back to one thread for BACKOFF_RUNS runs, then try
again. On a busy machine that costs two slow products every BACKOFF_RUNS runs.
"""

from __future__ import annotations

import contextlib
import time

import numpy as np

SERIAL_FLOPS = 1 << 26  # 2*M*N*K of one GEMM call below this: one BLAS thread (~1 ms)
# 2*M*N*K from here to SERIAL_FLOPS: within a run, BLAS's own threads while they keep up
MID_FLOPS = 1 << 22
SAMPLES = 3  # runs timed with mid-size products on one thread, then on BLAS's, before choosing
STALL_FACTOR = 3.0  # a threaded product this much slower than its best on one thread
BACKOFF_RUNS = 16  # runs whose mid-size products go back to one thread after a stall
KEPT_SHAPES = 1024  # shapes and runs whose times are kept (dynamic shapes make new ones)

_controllers: list | None = None


def _blas_controllers() -> list:
    global _controllers  # noqa: PLW0603 - found once per process
    if _controllers is None:
        try:
            from threadpoolctl import ThreadpoolController  # noqa: PLC0415
        except ImportError:
            _controllers = []
        else:
            found = [c for c in ThreadpoolController().lib_controllers
                     if c.user_api == "blas"]
            # NumPy's own BLAS when it can be told apart: another one in the process
            # (SciPy's, which numba loads with the compiled kernels) runs none of NumPy's
            # products, and switching it too doubles the cost of every switch
            numpy_blas = _numpy_blas_version()
            _controllers = [c for c in found if c.version == numpy_blas] or found
    return _controllers


def _numpy_blas_version() -> str | None:
    """The version of the BLAS NumPy was built against, as its build configuration says."""
    try:
        config = np.show_config(mode="dicts")
        return config["Build Dependencies"]["blas"]["version"]
    except (TypeError, KeyError, AttributeError):  # NumPy before 1.25, or no BLAS entry
        return None


def _lower_to_one() -> list:
    """Every controlled BLAS on one thread; the (controller, count) pairs to restore."""
    previous = []
    for controller in _blas_controllers():
        count = controller.get_num_threads()
        if count is not None and count > 1:
            controller.set_num_threads(1)
            previous.append((controller, count))
    return previous


def _restore(previous: list) -> None:
    for controller, count in previous:
        controller.set_num_threads(count)


def thread_count() -> int | None:
    """The threads NumPy's BLAS runs a large product on now; None where it cannot be told."""
    counts = [c.get_num_threads() for c in _blas_controllers()]
    counts = [c for c in counts if c is not None]
    return counts[0] if counts else None


@contextlib.contextmanager
def threads_set(count: int):
    """NumPy's BLAS on ``count`` threads inside the block, as it was after it. OpenBLAS
    splits a product's sums differently with another thread count (a large product's last
    bits can move), so a resumed run sets the count the checkpoint's run had."""
    previous = []
    for controller in _blas_controllers():
        now = controller.get_num_threads()
        if now is not None and now != count:
            controller.set_num_threads(count)
            previous.append((controller, now))
    try:
        yield
    finally:
        _restore(previous)


@contextlib.contextmanager
def one_thread():
    """BLAS on one thread inside, its previous count restored after."""
    previous = _lower_to_one()
    try:
        yield
    finally:
        _restore(previous)


class BlasThreads:
    """The BLAS thread count over one run of a session (see the module's docstring).

    Between ``hold()`` and ``release()`` (``Session.run`` calls the latter in its
    ``finally``) a count lowered for a small product stays lowered until ``restore()``: a
    large product, a caller's hook or the end of the run. Outside them every small product
    restores the count right after itself. ``hold(key)`` names what the run computes (the
    session's plan and its feeds' shapes): runs of one key learn whether their mid-size
    products are faster on one thread or on BLAS's, ``run_completed()`` giving each run's
    time."""

    __slots__ = ("_lowered", "_holding", "_runs", "_serial_until", "_best_serial", "_stalls",
                 "_run_times", "_run_key", "_run_start", "_mid_threaded", "_mid_products")

    def __init__(self):
        self._lowered: list | None = None  # (controller, count) pairs while lowered
        self._holding = False
        self._runs = 0  # runs held so far
        self._serial_until = 0  # mid-size products on one thread until this run (a stall)
        self._best_serial: dict[tuple, float] = {}  # a mid-size shape's best serial seconds
        self._stalls = 0  # threaded mid-size products of this run that stalled
        # a run's key -> [best run seconds with its mid-size products on one thread, such
        # runs, best with them on BLAS's threads, such runs]
        self._run_times: dict = {}
        self._run_key = None
        self._run_start = 0.0
        self._mid_threaded = False  # this run's mid-size products on BLAS's threads
        self._mid_products = 0  # mid-size products this run made

    def hold(self, key=None) -> None:
        self._holding = True
        self._runs += 1
        self._stalls = 0
        self._mid_products = 0
        self._run_key = key
        times = self._run_times.get(key) if key is not None else None
        if times is None or self._runs <= self._serial_until or times[1] < SAMPLES:
            self._mid_threaded = False
        elif times[3] < SAMPLES:
            self._mid_threaded = True
        else:
            self._mid_threaded = times[2] < times[0]
        self._run_start = _clock()

    def run_completed(self) -> None:
        """The held run finished without error: its time counts for its key, if it made
        mid-size products (without them both ways are the same run)."""
        key = self._run_key
        if key is None or not self._mid_products:
            return
        elapsed = _clock() - self._run_start
        times = self._run_times.get(key)
        if times is None:
            if len(self._run_times) >= KEPT_SHAPES:
                self._run_times.clear()  # each key learns its times again
            times = self._run_times[key] = [_NEVER, 0, _NEVER, 0]
        at = 2 if self._mid_threaded else 0
        times[at] = min(times[at], elapsed)
        times[at + 1] += 1

    def release(self) -> None:
        self._holding = False
        self.restore()

    def restore(self) -> None:
        """BLAS's own count back, if this object lowered it."""
        lowered, self._lowered = self._lowered, None
        if lowered:
            _restore(lowered)

    def small_matmul(self, a, b, flops: int, out=None):
        """A product below SERIAL_FLOPS (``flops``: 2*M*N*K of one GEMM call): on one thread,
        or on BLAS's threads when it is a run's mid-size product and they keep up."""
        if self._holding and flops >= MID_FLOPS:
            return self._mid_matmul(a, b, out)
        return self.serial_matmul(a, b, out)

    def _mid_matmul(self, a, b, out=None):
        self._mid_products += 1
        shape = (a.shape, b.shape, a.dtype, b.dtype)
        best = self._best_serial.get(shape)
        if not self._mid_threaded or best is None:
            start = _clock()
            out = self.serial_matmul(a, b, out)
            elapsed = _clock() - start
            if best is None and len(self._best_serial) >= KEPT_SHAPES:
                self._best_serial.clear()  # each shape learns its time again
            if best is None or elapsed < best:
                self._best_serial[shape] = elapsed
            return out
        self.restore()
        start = _clock()
        out = _product(a, b, out)
        if _clock() - start > STALL_FACTOR * best:
            # the first threaded product after a quiet stretch waits for BLAS's sleeping
            # threads to wake: only a second stall in one run is taken for a busy machine
            self._stalls += 1
            if self._stalls >= 2:
                self._serial_until = self._runs + BACKOFF_RUNS
        return out

    def serial_matmul(self, a, b, out=None):
        """``a @ b`` on one BLAS thread."""
        if self._lowered is None:
            self._lowered = _lower_to_one()
        if self._holding:
            return _product(a, b, out)
        try:
            return _product(a, b, out)
        finally:
            self.restore()


def matmul(xp, a, b, blas: BlasThreads | None = None, out=None):
    """``xp.matmul(a, b)``, on one BLAS thread when each GEMM call BLAS sees (the product of
    the last two axes: NumPy loops over the leading ones) is below SERIAL_FLOPS. ``blas``
    (the running session's) keeps the count lowered between small products of one run;
    without it the count is switched and restored around this product. ``out``: an array
    of the product's shape and dtype to write it into (NumPy only)."""
    if xp is not np or a.ndim < 2 or b.ndim < 2:
        return xp.matmul(a, b)
    flops = 2 * a.shape[-2] * a.shape[-1] * b.shape[-1]  # of one GEMM call
    if flops >= SERIAL_FLOPS or not _blas_controllers():
        if blas is not None:
            blas.restore()
        return _product(a, b, out)
    if blas is None:
        with one_thread():
            return _product(a, b, out)
    return blas.small_matmul(a, b, flops, out)


_NEVER = float("inf")  # the best time of a shape not yet timed that way


def _product(a, b, out):
    return _numpy_matmul(a, b) if out is None else _numpy_matmul(a, b, out=out)


_numpy_matmul = np.matmul  # a name of this module, so a test can watch the calls
_clock = time.perf_counter  # and one a test can drive

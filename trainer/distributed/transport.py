"""Gradient transports: how a bucket is summed across ranks. MPI through the host
(:class:`MpiTransport`, float32 buckets), or NCCL (RCCL on ROCm) on the GPU
(:class:`NcclTransport`, buckets on the device in the gradients' own dtype) when every rank can
use it; :func:`make_transport` chooses, and every rank agrees on the choice.

A transport gives ``bucket_dtype(gradient dtype)``, ``buffer(n, dtype)``,
``stage(buffer, offset, value)``, ``start(buffer) -> handle``, ``done(handles)``,
``poke(handles)`` (drive progress while other work runs) and ``finish(buffer, divisor) ->
(float32 gradients, finite)``; ``device_resident`` says where: host arrays and a bool (MPI),
or device arrays and a device flag nothing has read back yet (NCCL: the trainer reads it
together with the loss, the step's one device->host copy).

FP16 gradients (``--precision mixed``/``fp16``) are all-reduced as FP16 on the device, half the
bytes of float32 buckets. NCCL adds FP16 in FP16 (``FuncSum<half>`` is ``__hadd2`` on sm_53+,
NVIDIA/nccl ``src/collectives/device/reduce_kernel.h``), so a sum of N gradients could
overflow where each one does not. As PyTorch DDP's reducer does (``copy_grad_to_bucket``:
``at::mul_out(bucket_view, grad, 1 / div_factor_)``), each rank's gradient is multiplied by
1/N while it is copied into the bucket, so the summed bucket is the mean and is never larger
in magnitude than the largest rank's gradient (up to rounding); the loss-scale division then
runs in float32 after the sum. An overflow that still happens (a rank's own gradient is inf)
is an inf in the all-reduced bucket, identical on every rank: with dynamic loss scaling the
step is skipped and the scale backs off everywhere (GradScaler's behaviour under DDP), with a
static scale training stops with the non-finite report. The cost of dividing first: log2(N)
bits off the FP16 subnormal range, which is where loss scaling keeps gradients away from.
"""
from __future__ import annotations

import threading

import numpy as np

from .job import SETUP_TIMEOUT_MIN, Communicator


class MpiTransport:
    """Host float32 buckets, MPI Iallreduce (SUM, in place)."""

    name = "MPI"
    device_resident = False

    def __init__(self, comm: Communicator, backend, fallback_reason: str | None = None):
        self.comm, self.backend = comm, backend
        if fallback_reason:  # a GPU job that could not use NCCL says why
            self.name = f"MPI through the host (not NCCL: {fallback_reason})"

    def bucket_dtype(self, grad_dtype) -> np.dtype:
        return np.dtype(np.float32)

    def buffer(self, size: int, dtype=np.float32):
        return np.zeros(size, np.float32)

    def stage(self, buffer, offset: int, value) -> None:
        flat = np.asarray(self.backend.to_host(value)).reshape(-1)
        buffer[offset:offset + flat.size] = flat

    def start(self, buffer):
        return self.comm.iallreduce_inplace(buffer)

    def done(self, handles) -> bool:
        return self.comm.MPI.Request.Testall(handles)

    poke = done   # Testall also drives MPI's progress engine

    def finish(self, buffer, divisor: float) -> tuple[np.ndarray, bool]:
        buffer /= np.float32(divisor)
        return buffer, bool(np.isfinite(buffer).all())


# NCCL's names for the bucket dtypes (cupy/cuda/nccl.pxd: NCCL_FLOAT16 = 6, NCCL_FLOAT32 = 7)
NCCL_TYPES = {np.dtype(np.float16): "NCCL_FLOAT16", np.dtype(np.float32): "NCCL_FLOAT32"}


class DeviceBuckets:
    """Buckets on the device in the gradients' own dtype; nothing is read back here.
    ``xp`` is the array module (CuPy), ``ranks`` the number of ranks summing. The collective
    itself (``start``/``done``/``poke``) is the subclass's."""

    device_resident = True

    def __init__(self, xp, ranks: int):
        self.xp, self.ranks = xp, int(ranks)

    def bucket_dtype(self, grad_dtype) -> np.dtype:
        return np.dtype(np.float16 if np.dtype(grad_dtype) == np.float16 else np.float32)

    def buffer(self, size: int, dtype=np.float32):
        return self.xp.zeros(size, dtype)

    def _predivided(self, buffer) -> bool:
        return buffer.dtype == np.float16 and self.ranks > 1

    def stage(self, buffer, offset: int, value) -> None:
        flat = self.xp.reshape(value, (-1,))
        target = buffer[offset:offset + flat.size]
        if self._predivided(buffer):   # the mean, not the sum, is what FP16 holds (see above)
            self.xp.multiply(flat, np.float32(1.0 / self.ranks), out=target, dtype=np.float32)
        else:
            target[...] = flat

    def _join(self) -> None:
        """The compute stream waits for the collectives (NCCL's side stream)."""

    def finish(self, buffer, divisor: float):
        """(float32 gradients on the device, a device bool: all finite); no host read."""
        self._join()
        rest = divisor / self.ranks if self._predivided(buffer) else divisor
        # the single-rank trainer's arithmetic: float32 copy, one float32 division
        grads = buffer if buffer.dtype == np.float32 else buffer.astype(np.float32)
        if rest != 1.0:
            grads /= np.float32(rest)
        return grads, self.xp.isfinite(grads).all()


class NcclTransport(DeviceBuckets):
    """Device buckets all-reduced with NCCL (RCCL on ROCm) via ``cupy.cuda.nccl`` on a side
    stream that waits for the compute stream. The unique id comes from rank 0 over MPI;
    completion is a CUDA event polled under the communicator's deadline."""

    name = "NCCL"

    def __init__(self, comm: Communicator, backend):
        import cupy  # noqa: PLC0415
        from cupy.cuda import nccl  # noqa: PLC0415

        super().__init__(cupy, comm.size)
        self.cupy, self.nccl, self.comm = cupy, nccl, comm
        limit = max(comm.timeout, SETUP_TIMEOUT_MIN)
        uid = None
        if comm.rank == 0:
            try:
                uid = nccl.get_unique_id()
            except Exception as exc:  # noqa: BLE001 - every rank must learn it failed
                uid = f"rank 0 could not get an NCCL unique id: {type(exc).__name__}: {exc}"
        uid = comm.bcast_object(uid, 0, "the NCCL unique-id broadcast", limit)
        if isinstance(uid, str):
            raise RuntimeError(uid)
        # every rank is here (the broadcast completed); the NCCL init blocks until all ranks
        # join, so it runs on a thread and is waited for under the communicator's deadline
        result: dict = {}

        def init():
            try:
                result["comm"] = nccl.NcclCommunicator(comm.size, uid, comm.rank)
            except Exception as exc:  # noqa: BLE001 - handed to the caller below
                result["error"] = exc

        worker = threading.Thread(target=_on_device(cupy.cuda.Device(), init),
                                  name="nccl-init", daemon=True)
        worker.start()
        comm.wait(lambda: not worker.is_alive(), 0, "the NCCL communicator set-up", limit)
        if "error" in result:
            raise result["error"]
        self.nccl_comm = result["comm"]
        comm.on_abort.append(self.nccl_comm.abort)
        self.stream = cupy.cuda.Stream(non_blocking=True)
        self.name = "RCCL" if getattr(cupy.cuda.runtime, "is_hip", False) else "NCCL"

    def start(self, buffer):
        ready = self.cupy.cuda.get_current_stream().record()
        self.stream.wait_event(ready)
        datatype = getattr(self.nccl, NCCL_TYPES[np.dtype(buffer.dtype)])
        self.nccl_comm.allReduce(buffer.data.ptr, buffer.data.ptr, buffer.size,
                                 datatype, self.nccl.NCCL_SUM, self.stream.ptr)
        return self.stream.record()

    def done(self, handles) -> bool:
        return all(event.done for event in handles)

    def poke(self, handles) -> bool:
        return True   # NCCL progresses on its own

    def _join(self) -> None:
        self.cupy.cuda.get_current_stream().wait_event(self.stream.record())


def _on_device(device, fn):
    """``fn`` run with ``device`` current (a new thread starts on device 0)."""
    def run():
        with device:
            fn()
    return run


def nccl_unusable(comm: Communicator) -> str | None:
    """Why this rank cannot all-reduce with NCCL/RCCL (None when it can)."""
    try:
        import cupy  # noqa: PLC0415
        from cupy.cuda import nccl  # noqa: PLC0415
    except ImportError as exc:
        return f"cupy.cuda.nccl does not import ({exc})"
    if not getattr(nccl, "available", False):  # the module imports even without libnccl
        return ("CuPy finds no NCCL library (pip install nvidia-nccl-cu12 or -cu13, as "
                "graphopt[cuda] does; RCCL comes with ROCm)")
    try:
        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception as exc:  # noqa: BLE001 - the runtime's own error types
        return f"no GPU runtime ({exc})"
    if comm.local_size > count:
        return (f"{comm.local_size} ranks on this host share {count} GPU(s), and NCCL "
                "refuses two ranks on one GPU")
    return None


def _all_agree(comm: Communicator, ok: bool, what: str) -> bool:
    """True when ``ok`` holds on every rank (one small all-reduce)."""
    failed = comm.allreduce_sum(np.array([0 if ok else 1], np.int64), 0, what,
                                max(comm.timeout, SETUP_TIMEOUT_MIN))
    return int(failed[0]) == 0


def make_transport(comm: Communicator, backend):
    """NCCL (RCCL) on GPUs when every rank can use it, else MPI through the host; all ranks
    agree on the choice, and the MPI transport says why NCCL was not used."""
    if not getattr(backend, "is_gpu", False):
        return MpiTransport(comm, backend)
    reason = nccl_unusable(comm)
    if not _all_agree(comm, reason is None, "choosing the gradient transport"):
        return MpiTransport(comm, backend, reason or "NCCL is unusable on another rank")
    try:
        transport, error = NcclTransport(comm, backend), None
    except Exception as exc:  # noqa: BLE001 - NcclError and its kin; every rank agrees below
        transport, error = None, exc
    if not _all_agree(comm, transport is not None, "the NCCL communicator set-up"):
        if transport is not None:
            transport.nccl_comm.abort()
        why = (f"NCCL set-up failed ({type(error).__name__}: {error})" if error is not None
               else "NCCL set-up failed on another rank")
        return MpiTransport(comm, backend, why)
    return transport

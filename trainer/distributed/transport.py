"""Gradient transports: how a float32 bucket is summed across ranks. MPI through the host
(:class:`MpiTransport`), or NCCL (RCCL on ROCm) on the GPU (:class:`NcclTransport`) when every
rank can use it; :func:`make_transport` chooses, and every rank agrees on the choice.

A transport gives ``buffer(n)``, ``stage(buffer, offset, value)``, ``start(buffer) -> handle``,
``done(handles)``, ``poke(handles)`` (drive progress while other work runs) and
``finish(buffer, divisor) -> (host float32 array, finite)``.
"""
from __future__ import annotations

import threading

import numpy as np

from .job import SETUP_TIMEOUT_MIN, Communicator


class MpiTransport:
    """Host float32 buckets, MPI Iallreduce (SUM, in place)."""

    name = "MPI"

    def __init__(self, comm: Communicator, backend, fallback_reason: str | None = None):
        self.comm, self.backend = comm, backend
        if fallback_reason:  # a GPU job that could not use NCCL says why
            self.name = f"MPI through the host (not NCCL: {fallback_reason})"

    def buffer(self, size: int):
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


class NcclTransport:
    """Device float32 buckets, all-reduced with NCCL (RCCL on ROCm) via ``cupy.cuda.nccl``
    on a side stream that waits for the compute stream. The unique id comes from rank 0 over
    MPI; completion is a CUDA event polled under the communicator's deadline."""

    name = "NCCL"

    def __init__(self, comm: Communicator, backend):
        import cupy  # noqa: PLC0415
        from cupy.cuda import nccl  # noqa: PLC0415

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

    def buffer(self, size: int):
        return self.cupy.zeros(size, self.cupy.float32)

    def stage(self, buffer, offset: int, value) -> None:
        flat = self.cupy.asarray(value).reshape(-1)
        buffer[offset:offset + flat.size] = flat

    def start(self, buffer):
        ready = self.cupy.cuda.get_current_stream().record()
        self.stream.wait_event(ready)
        self.nccl_comm.allReduce(buffer.data.ptr, buffer.data.ptr, buffer.size,
                                 self.nccl.NCCL_FLOAT32, self.nccl.NCCL_SUM, self.stream.ptr)
        return self.stream.record()

    def done(self, handles) -> bool:
        return all(event.done for event in handles)

    def poke(self, handles) -> bool:
        return True   # NCCL progresses on its own

    def finish(self, buffer, divisor: float) -> tuple[np.ndarray, bool]:
        self.cupy.cuda.get_current_stream().wait_event(self.stream.record())
        buffer /= self.cupy.float32(divisor)
        finite = bool(self.cupy.isfinite(buffer).all())
        return buffer.get(), finite


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

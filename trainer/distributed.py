"""Data-parallel training behind ``graphopt run --distributed`` (issue 8).

Launch N copies with ``mpirun -n N`` / ``mpiexec -n N`` / ``srun``; every copy reads its rank
and the world size from MPI itself (``MPI.COMM_WORLD``), never from launcher variables.

What each rank does, per step:

- data: the same global order for the epoch (:class:`~.data.Batches`, a pure function of
  (seed, epoch)); ``--batch-size B`` is the *global* batch and rank ``r`` takes rows
  ``[r*B/N, (r+1)*B/N)`` of every global batch, so N ranks with B/N each see exactly the
  samples one rank with B sees (:class:`ShardedBatches`);
- gradients: flattened into a few contiguous float32 buckets (``--bucket-mb``, 25 MiB by
  default, filled in the order the backward pass produces the gradients) and summed with one
  all-reduce per bucket, then divided by N (and by the loss scale). With overlap on (the
  default) a bucket's non-blocking all-reduce starts inside the executor run, right after
  the node producing its last gradient, while the rest of the backward pass computes (see
  :class:`GradientReducer` for how, and why not through ``Session.run(observer=...)``);
- agreement: one more tiny all-reduce carries (loss, overflow flag, Ctrl-C flag), so the
  reported loss is the global mean, one rank's inf/NaN skips the step on every rank (the
  loss scaler moves identically everywhere) and Ctrl-C stops every rank after the same step;
- weights: rank 0's initial (or resumed) weights are broadcast before the first step;
  ``--dist-check-every K`` compares a CRC of the weights across ranks every K steps;
- output: rank 0 alone writes the log, checkpoints, plot and model and shows progress (its
  samples/s are global: the global batch per step).

Every collective waits with a deadline (non-blocking request + Test polling, ``--dist-timeout``
seconds). On expiry the waiting ranks ask each other, point to point on a separate
communicator, which ranks are still alive, print ``rank K did not reach step S within T s``
naming the silent ones, and abort the job (``MPI_Abort``, exit status 124). A rank that fails
with an error prints it with its rank and aborts the job at once. ``--resume`` restarts the
whole job from the last checkpoint (written by rank 0; read by rank 0 and broadcast, so other
nodes need not see the file system). The checkpoint stores the global batch size, so a job
may resume on a different number of ranks.

GPUs: each rank binds the GPU ``local_rank % devices`` and all-reduces the buckets on the
device with NCCL (RCCL on ROCm) through ``cupy.cuda.nccl``, bootstrapped by broadcasting
NCCL's unique id over MPI; completion is polled through CUDA events with the same deadline,
and a timeout aborts the NCCL communicator before MPI_Abort.
"""
from __future__ import annotations

import math
import os
import pickle
import socket
import sys
import threading
import time
import zlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from graphopt.errors import GraphoptError

from . import checkpoint as ckpt
from .data import Batches
from .loop import Trainer

EXIT_TIMEOUT = 124          # a rank missed a deadline: the job is aborted with this status
EXIT_ERROR = 1              # a rank raised an error: the job is aborted with this status
SETUP_TIMEOUT_MIN = 60.0    # start-up collectives wait at least this long (imports, graph build)
MIB = 1 << 20
ABORT_GRACE = 0.5           # seconds between the error message and MPI_Abort


@dataclass
class DistSettings:
    bucket_mb: float = 25.0         # MiB of float32 gradients per all-reduce bucket
    timeout: float = 300.0          # seconds any collective may wait for the other ranks
    check_every: int = 0            # compare weight checksums every K steps (0: never)
    overlap: bool = True            # start bucket all-reduces during the backward pass

    def validate(self) -> None:
        if not self.bucket_mb > 0:
            raise GraphoptError(f"--bucket-mb must be positive, not {self.bucket_mb}")
        if not self.timeout > 0:
            raise GraphoptError(f"--dist-timeout must be positive, not {self.timeout}")
        if self.check_every < 0:
            raise GraphoptError(f"--dist-check-every must be >= 0, not {self.check_every}")


def import_mpi():
    try:
        from mpi4py import MPI  # noqa: PLC0415  (initializes MPI on first import)
    except ImportError as exc:
        raise GraphoptError(f"--distributed needs mpi4py and an MPI library ({exc}); install "
                            "them with: pip install 'graphopt[distributed]' (mpi4py + the "
                            "mpich wheel, which provides mpiexec)") from None
    return MPI


# -- the communicator ------------------------------------------------------------------------
class Communicator:
    """MPI_COMM_WORLD with deadline-bounded collectives.

    Owns two duplicates of the world communicator: ``comm`` for the training collectives and
    ``diag`` for the who-is-alive exchange after a timeout (so diagnostic messages never
    match a training collective).
    """

    def __init__(self, timeout: float = 300.0, *, stream=None):
        MPI = import_mpi()
        self.MPI = MPI
        world = MPI.COMM_WORLD
        self.rank, self.size = world.Get_rank(), world.Get_size()
        self.timeout = float(timeout)
        self.stream = stream if stream is not None else sys.stderr
        self.on_abort: list[Callable[[], None]] = []   # e.g. the NCCL communicator's abort
        self.diag = None
        self.wait_seconds = 0.0                         # time spent waiting in collectives
        setup = max(self.timeout, SETUP_TIMEOUT_MIN)
        self.comm = self._dup(world, setup)
        self.diag = self._dup(world, setup)
        self.local_rank, self.local_size = self._local_rank(setup)

    # -- set-up ---------------------------------------------------------------------------
    def _dup(self, world, limit):
        comm, request = world.Idup()
        self.wait(lambda: request.Test(), 0, "MPI set-up (communicator duplication)", limit)
        return comm

    def _local_rank(self, limit) -> tuple[int, int]:
        """(rank among the ranks on this host, ranks on this host), from host-name hashes."""
        mine = np.array([zlib.crc32(socket.gethostname().encode())], np.int64)
        hosts = np.empty(self.size, np.int64)
        request = self.comm.Iallgather(mine, hosts)
        self.wait(lambda: request.Test(), 0, "MPI set-up (host names)", limit)
        same = hosts == mine[0]
        return int(same[:self.rank].sum()), int(same.sum())

    # -- waiting with a deadline ------------------------------------------------------------
    def wait(self, done: Callable[[], bool], step: int, what: str,
             timeout: float | None = None) -> None:
        """Poll ``done()`` until it is true; past the deadline name the missing ranks and
        abort. Polls back to back for the first 50 ms, yielding the core between polls (MPI
        moves large messages only while it is polled, and an oversubscribed machine still
        gets its cores), then sleeps 50 us .. 1 ms between polls."""
        limit = self.timeout if timeout is None else timeout
        start = time.monotonic()
        pause = 0.0
        try:
            while not done():
                waited = time.monotonic() - start
                if waited > limit:
                    self.wait_seconds += waited
                    self._timed_out(step, what, limit)
                if waited < 0.05:
                    os.sched_yield()
                else:
                    time.sleep(pause)
                    pause = min(max(pause * 2, 5e-5), 1e-3)
        except self.MPI.Exception as exc:   # some transports report a dead peer as an error
            self._report_and_abort(f"MPI error at step {step} in {what}: {exc}",
                                   EXIT_ERROR, step)
        self.wait_seconds += time.monotonic() - start

    def _who_is_missing(self, step: int, grace: float) -> list[tuple[int, int | None]]:
        """Every waiting rank sends its step to every other rank on ``diag``; ranks not heard
        from within ``grace`` seconds are missing (None); ranks at another step are listed
        with theirs."""
        others = [r for r in range(self.size) if r != self.rank]
        inbox = {r: np.full(1, -1, np.int64) for r in others}
        receives = {r: self.diag.Irecv(inbox[r], source=r, tag=7) for r in others}
        mine = np.array([step], np.int64)
        sends = [self.diag.Isend(mine, dest=r, tag=7) for r in others]  # noqa: F841 (kept alive)
        deadline = time.monotonic() + grace
        heard: dict[int, int] = {}
        while time.monotonic() < deadline and len(heard) < len(others):
            for r, request in receives.items():
                if r not in heard and request.Test():
                    heard[r] = int(inbox[r][0])
            time.sleep(0.001)
        return [(r, heard.get(r)) for r in others if heard.get(r) != step]

    def _timed_out(self, step: int, what: str, limit: float) -> None:
        where = f"step {step}" if step else "the start of training"
        if self.diag is None:   # still setting up: no side channel to ask who is there
            self._report_and_abort(f"not every rank reached MPI set-up within {limit:g} s "
                                   f"(rank {self.rank} waited in {what}); aborting the job",
                                   EXIT_TIMEOUT, step)
        grace = min(max(1.0, limit / 4), 10.0)
        lagging = self._who_is_missing(step, grace)
        parts = [f"rank {r} did not reach {where} within {limit:g} s" if seen is None
                 else f"rank {r} is at step {seen}, not {step}" for r, seen in lagging]
        if not parts:
            parts = [f"{where} did not complete within {limit:g} s although every rank "
                     "answered (collectives out of order?)"]
        self._report_and_abort("; ".join(parts) + f" (rank {self.rank} waited in {what}); "
                               "aborting the job", EXIT_TIMEOUT, step)

    def _report_and_abort(self, message: str, code: int, step: int | None = None) -> None:
        prefix = f"graphopt: error: [rank {self.rank}/{self.size}] "
        try:
            self.stream.write(prefix + message + "\n")
            self.stream.flush()
        except Exception:  # noqa: BLE001 (nothing may stop the abort)
            pass
        # the launcher forwards our stderr through a pipe; MPI_Abort makes it kill every
        # process, and right away it can lose the line just written: give it a moment
        time.sleep(ABORT_GRACE)
        self.abort(code)

    def fail(self, exc: BaseException) -> None:
        """An error on this rank: say so and abort the job (the others would only wait)."""
        if isinstance(exc, KeyboardInterrupt):
            self._report_and_abort("interrupted", 130)
        text = str(exc) if isinstance(exc, GraphoptError) else f"{type(exc).__name__}: {exc}"
        self._report_and_abort(text, EXIT_ERROR)

    def abort(self, code: int) -> None:
        for hook in self.on_abort:
            try:
                hook()
            except Exception:  # noqa: BLE001
                pass
        self.MPI.COMM_WORLD.Abort(code)
        os._exit(code)  # not reached: MPI_Abort does not return

    # -- collectives ----------------------------------------------------------------------
    def allreduce_sum(self, values: np.ndarray, step: int, what: str,
                      timeout: float | None = None) -> np.ndarray:
        out = np.empty_like(values)
        request = self.comm.Iallreduce(values, out, op=self.MPI.SUM)
        self.wait(request.Test, step, what, timeout)
        return out

    def iallreduce_inplace(self, buffer: np.ndarray):
        return self.comm.Iallreduce(self.MPI.IN_PLACE, buffer, op=self.MPI.SUM)

    def allgather(self, values: np.ndarray, step: int, what: str,
                  timeout: float | None = None) -> np.ndarray:
        out = np.empty((self.size, *values.shape), values.dtype)
        request = self.comm.Iallgather(values, out)
        self.wait(request.Test, step, what, timeout)
        return out

    def bcast_array(self, array: np.ndarray, step: int, what: str,
                    timeout: float | None = None) -> None:
        """In place, from rank 0 (``array`` must be C-contiguous)."""
        if not array.size:
            return
        request = self.comm.Ibcast(array, root=0)
        self.wait(request.Test, step, what, timeout)

    def bcast_object(self, obj, step: int, what: str, timeout: float | None = None):
        """A picklable object from rank 0 (length first, then the bytes)."""
        payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if self.rank == 0 else b""
        length = np.array([len(payload)], np.int64)
        self.bcast_array(length, step, what, timeout)
        buffer = (np.frombuffer(payload, np.uint8).copy() if self.rank == 0
                  else np.empty(int(length[0]), np.uint8))
        self.bcast_array(buffer, step, what, timeout)
        return obj if self.rank == 0 else pickle.loads(buffer.tobytes())


_WORLD: Communicator | None = None


def world(timeout: float = 300.0) -> Communicator:
    """The process's communicator (created once; a later run only changes the timeout)."""
    global _WORLD
    if _WORLD is None:
        _WORLD = Communicator(timeout)
    _WORLD.timeout = float(timeout)
    return _WORLD


def bind_device(device: str, comm: Communicator) -> None:
    """Each rank on a host takes its own GPU: ``local_rank % device count``. With more ranks
    than GPUs on a host, ranks share GPUs; NCCL refuses that ("Duplicate GPU detected"), so
    :func:`make_transport` then all-reduces over MPI instead."""
    if device == "cpu":
        return
    try:
        import cupy  # noqa: PLC0415
        count = int(cupy.cuda.runtime.getDeviceCount())
    except Exception:  # noqa: BLE001 (no CuPy or no driver: the session decides what to say)
        return
    if count:
        cupy.cuda.Device(comm.local_rank % count).use()


@dataclass
class Distributed:
    """What ``graphopt run`` needs to know about the job."""
    comm: Communicator
    settings: DistSettings

    @property
    def rank(self) -> int:
        return self.comm.rank

    @property
    def size(self) -> int:
        return self.comm.size

    @property
    def writer(self) -> bool:
        """Rank 0 writes logs, checkpoints, plots and the model, and shows progress."""
        return self.comm.rank == 0


def start(enabled: bool, bucket_mb: float | None = None, timeout: float | None = None,
          check_every: int | None = None, overlap: bool | None = None) -> Distributed | None:
    """The job's communicator for ``--distributed`` (None without it)."""
    given = {"--bucket-mb": bucket_mb, "--dist-timeout": timeout,
             "--dist-check-every": check_every, "--dist-overlap/--no-dist-overlap": overlap}
    if not enabled:
        named = [name for name, value in given.items() if value is not None]
        if named:
            raise GraphoptError(f"{', '.join(named)} only apply with --distributed")
        return None
    defaults = DistSettings()
    settings = DistSettings(
        defaults.bucket_mb if bucket_mb is None else float(bucket_mb),
        defaults.timeout if timeout is None else float(timeout),
        defaults.check_every if check_every is None else int(check_every),
        defaults.overlap if overlap is None else bool(overlap))
    settings.validate()
    return Distributed(world(settings.timeout), settings)


def fingerprint(trainer: Trainer, scaler_spec) -> str:
    """What must be the same on every rank (compared as a CRC at the start)."""
    scalars, _ = trainer.optimizer.state()
    scalars = {k: v for k, v in scalars.items() if k != "steps"}
    shapes = [(n, tuple(v.shape), str(v.dtype)) for n, v in trainer.params.items()]
    return repr((trainer.settings.total_steps, trainer.settings.precision, trainer.settings.seed,
                 trainer.batches.batch_size, trainer.batches.size, trainer.batches.seed,
                 sorted(scalars.items()), scaler_spec, shapes))


# -- data ------------------------------------------------------------------------------------
class ShardedBatches(Batches):
    """Rank ``rank``'s slice of every global batch. ``batch_size`` stays the global batch
    (progress counts global samples; checkpoints and ``--resume`` speak global steps), the
    arrays fed to the graph have ``local_batch`` rows."""

    def __init__(self, arrays: Mapping[str, np.ndarray], input_names: Sequence[str],
                 batch_size: int, seed: int, input_types: Mapping[str, tuple] | None,
                 rank: int, ranks: int):
        if batch_size % ranks:
            raise GraphoptError(f"--batch-size {batch_size} is the global batch; it must be "
                                f"divisible by the {ranks} ranks")
        super().__init__(arrays, input_names, batch_size, seed, None)
        self.rank, self.ranks, self.local_batch = rank, ranks, batch_size // ranks
        types = dict(input_types or {})
        for name, (_, dims) in types.items():
            if dims and isinstance(dims[0], int) and dims[0] != self.local_batch:
                raise GraphoptError(f"graph input {name!r} has a fixed batch size {dims[0]}; "
                                    f"with {ranks} ranks use --batch-size {dims[0] * ranks} "
                                    "(the global batch)")
        self.batch_size = self.local_batch   # the shape checks speak the per-rank batch
        try:
            self._check_types(types)
        finally:
            self.batch_size = batch_size

    def batch(self, step: int) -> dict[str, np.ndarray]:
        epoch, index = self.position(step)
        rows = self.order(epoch)[index * self.batch_size:(index + 1) * self.batch_size]
        mine = rows[self.rank * self.local_batch:(self.rank + 1) * self.local_batch]
        return {name: array[mine] for name, array in self.arrays.items()}


# -- gradient transports -------------------------------------------------------------------
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


# -- buckets ---------------------------------------------------------------------------------
@dataclass
class Bucket:
    params: list[str]
    offsets: list[int]
    sizes: list[int]
    shapes: list[tuple]
    numel: int
    ready_at: float                  # plan step index that produces its last gradient
    buffer: object = None
    handle: object = None
    staged: set = field(default_factory=set)


def plan_buckets(params: Sequence[str], shapes: Mapping[str, tuple],
                 produced_at: Mapping[str, float], bucket_bytes: int) -> list[Bucket]:
    """Parameters in the order their gradients are produced (ties: model order), packed
    greedily into buckets of at most ``bucket_bytes`` float32 bytes (a larger gradient gets a
    bucket of its own; gradients no planned step produces get buckets of their own, so they
    do not hold back the others); a bucket is ready when its last gradient is produced."""
    order = sorted(params, key=lambda p: (produced_at.get(p, math.inf), params.index(p)))
    buckets: list[Bucket] = []
    current: Bucket | None = None
    for name in order:
        size = int(np.prod(shapes[name], dtype=np.int64))
        late = produced_at.get(name, math.inf) == math.inf   # filled after the run
        if current is None or (current.numel and (current.numel + size) * 4 > bucket_bytes) \
                or (late and current.ready_at != math.inf):
            current = Bucket([], [], [], [], 0, -math.inf)
            buckets.append(current)
        current.params.append(name)
        current.offsets.append(current.numel)
        current.sizes.append(size)
        current.shapes.append(tuple(shapes[name]))
        current.numel += size
        current.ready_at = max(current.ready_at, produced_at.get(name, math.inf))
    return buckets


class GradientReducer:
    """Bucketed gradient all-reduce, overlapped with the backward pass.

    How the overlap is wired: ``Session.run(observer=...)`` calls the observer after each
    node with the node's *name and the live tensor names* only -- not the values -- and it
    builds that name list by scanning every slot after every node (O(nodes x tensors) per
    step). So instead this class wraps the kernel function (``Step.fn``) of the planned steps
    of the training fetches: after a step that produces a gradient, the gradient is copied
    into its bucket, and a bucket whose last gradient just arrived starts its non-blocking
    all-reduce; every later step pokes the pending requests (MPI progresses only when called;
    NCCL needs no poke). The wrappers act only while a step of this reducer is in flight.
    (A one-line change to Session -- passing the step's output values to the observer --
    would let this use the observer instead.) With ``overlap=False``, or for gradients no
    planned step produces, the buckets are filled and reduced after the run.
    """

    def __init__(self, trainer: Trainer, comm: Communicator, transport, bucket_bytes: int,
                 overlap: bool):
        self.comm, self.transport, self.overlap = comm, transport, overlap
        graph = trainer.graph
        self.grad_of = {p: graph.grads[p] for p in graph.params}
        plan = trainer.session.plan(trainer.fetches)
        produced: dict[str, int] = {}
        for index, step in enumerate(plan.steps):
            for out in step.node.outputs:
                if out:
                    produced.setdefault(out, index)
        produced_at = {p: produced.get(g, math.inf) for p, g in self.grad_of.items()}
        shapes = {p: trainer.params[p].shape for p in graph.params}
        self.buckets = plan_buckets(list(graph.params), shapes, produced_at, bucket_bytes)
        self.slots: dict[str, list[tuple[Bucket, int, int]]] = {}
        for bucket in self.buckets:
            bucket.buffer = transport.buffer(bucket.numel)
            for name, offset, size in zip(bucket.params, bucket.offsets, bucket.sizes,
                                          strict=True):
                self.slots.setdefault(self.grad_of[name], []).append((bucket, offset, size))
        self.active = False
        self.pending: list = []
        self.launched = self.launched_in_backward = 0   # bucket all-reduces, all / overlapped
        self.gradient_bytes = sum(b.numel for b in self.buckets) * 4
        if overlap:
            self._install(plan)

    # -- taps in the plan ---------------------------------------------------------------
    def _install(self, plan) -> None:
        ready: dict[int, list[Bucket]] = {}
        for bucket in self.buckets:
            if bucket.ready_at != math.inf:
                ready.setdefault(int(bucket.ready_at), []).append(bucket)
        if not ready:
            return
        first = None   # the first step producing a gradient: taps and pokes from there on
        for index, step in enumerate(plan.steps):
            taps = [(position, out) for position, out in enumerate(step.node.outputs)
                    if out in self.slots]
            if taps and first is None:
                first = index
            if first is None or getattr(step.fn, "_graphopt_reducer", None) is not None:
                continue
            step.fn = self._wrap(step.fn, taps, ready.get(index, []))

    def _wrap(self, fn, taps, launches):
        reducer = self

        def tapped(ctx, node, *args):
            result = fn(ctx, node, *args)
            if reducer.active:
                if taps:
                    values = result if isinstance(result, (tuple, list)) else (result,)
                    for position, name in taps:
                        reducer.stage(name, values[position])
                for bucket in launches:
                    reducer.launch(bucket)
                if reducer.pending:
                    reducer.transport.poke(reducer.pending)
            return result

        tapped._graphopt_reducer = reducer
        return tapped

    # -- one step ---------------------------------------------------------------------------
    def begin(self) -> None:
        for bucket in self.buckets:
            bucket.staged.clear()
            bucket.handle = None
        self.pending = []
        self.active = self.overlap

    def stage(self, grad_name: str, value) -> None:
        for bucket, offset, size in self.slots[grad_name]:
            count = int(np.prod(getattr(value, "shape", ()), dtype=np.int64))
            if count != size:
                raise GraphoptError(f"gradient {grad_name!r} has {count} elements, its weight "
                                    f"has {size}")
            self.transport.stage(bucket.buffer, offset, value)
            bucket.staged.add(grad_name)

    def launch(self, bucket: Bucket) -> None:
        if bucket.handle is None:
            bucket.handle = self.transport.start(bucket.buffer)
            self.pending.append(bucket.handle)
            self.launched += 1
            if self.active:
                self.launched_in_backward += 1

    def finish(self, out: Mapping[str, np.ndarray], step: int) -> None:
        """Fill what the taps did not (no overlap, or gradients no step produced), start the
        remaining buckets in bucket order (the same on every rank), wait for all."""
        self.active = False
        for bucket in self.buckets:
            for name in bucket.params:
                grad = self.grad_of[name]
                if grad not in bucket.staged:
                    if bucket.handle is not None:   # would write into a buffer in flight
                        raise GraphoptError(f"internal error: gradient {grad!r} was not "
                                            "staged before its bucket's all-reduce started")
                    self.stage(grad, out[grad])
            self.launch(bucket)
        self.comm.wait(lambda: self.transport.done(self.pending), step,
                       f"the gradient all-reduce ({len(self.buckets)} bucket(s), "
                       f"{self.transport.name})")

    def gradients(self, divisor: float) -> tuple[dict[str, np.ndarray], bool]:
        """Averaged, unscaled float32 gradients (views of the buckets) and their finiteness
        on this rank."""
        grads: dict[str, np.ndarray] = {}
        finite = True
        for bucket in self.buckets:
            host, ok = self.transport.finish(bucket.buffer, divisor)
            finite = finite and ok
            for name, offset, size, shape in zip(bucket.params, bucket.offsets, bucket.sizes,
                                                 bucket.shapes, strict=True):
                grads[name] = host[offset:offset + size].reshape(shape)
        return grads, finite


# -- the trainer -----------------------------------------------------------------------------
def weights_checksum(params: Mapping[str, np.ndarray]) -> int:
    crc = 0
    for value in params.values():
        crc = zlib.crc32(np.ascontiguousarray(value).view(np.uint8), crc)
    return crc


class DistributedTrainer(Trainer):
    """:class:`~.loop.Trainer` with the data-parallel hooks; rank 0 writes checkpoints."""

    weights_on_device = False  # buckets, broadcasts and checksums work on host weights

    def __init__(self, *args, comm: Communicator, dist: DistSettings, **kwargs):
        super().__init__(*args, **kwargs)
        self.comm, self.dist = comm, dist
        self.transport = make_transport(comm, self.session.backend)
        self.reducer = GradientReducer(self, comm, self.transport,
                                       max(1, int(dist.bucket_mb * MIB)), dist.overlap)
        self._agreed_stop = False

    @property
    def setup_timeout(self) -> float:
        return max(self.comm.timeout, SETUP_TIMEOUT_MIN)

    def describe(self) -> str:
        r = self.reducer
        return (f"data parallel over {self.comm.size} ranks ({self.batches.local_batch} samples "
                f"per rank per step); {len(r.buckets)} gradient bucket(s) of up to "
                f"{self.dist.bucket_mb:g} MiB ({r.gradient_bytes / MIB:.2f} MiB in all) "
                f"all-reduced with {self.transport.name}"
                f"{', overlapped with the backward pass' if r.overlap else ' after backward'}; "
                f"timeout {self.comm.timeout:g} s")

    # -- start: same settings, rank 0's weights everywhere -----------------------------------
    def check_same_settings(self, fingerprint: str) -> None:
        mine = np.array([zlib.crc32(fingerprint.encode())], np.int64)
        every = self.comm.allgather(mine, 0, "the settings check", self.setup_timeout)[:, 0]
        different = [r for r in range(self.comm.size) if every[r] != every[0]]
        if different:
            raise GraphoptError(f"rank(s) {different} were started with other settings than "
                                "rank 0 (model, data, batch size, optimizer, steps); launch "
                                "every rank with the same command")

    def broadcast_weights(self) -> None:
        for name, value in self.params.items():
            if not value.flags.c_contiguous:
                value = self.params[name] = np.ascontiguousarray(value)
            self.comm.bcast_array(value, self.step, "the broadcast of rank 0's weights",
                                  self.setup_timeout)

    def _read_checkpoint(self, directory: str) -> ckpt.Checkpoint:
        state: object
        if self.comm.rank == 0:
            try:
                state = ckpt.load(directory)
            except GraphoptError as exc:
                state = exc
        else:
            state = None
        state = self.comm.bcast_object(state, 0, "the checkpoint broadcast",
                                       self.setup_timeout)
        if isinstance(state, GraphoptError):
            raise GraphoptError(f"(rank 0) {state}")
        return state

    def save_checkpoint(self, directory: str) -> str | None:
        if self.comm.rank != 0:
            return None
        return super().save_checkpoint(directory)

    # -- a step ---------------------------------------------------------------------------
    def _run_graph(self, feeds: dict) -> dict:
        self.reducer.begin()
        try:
            return self.session.run(feeds, self.fetches)
        finally:
            self.reducer.active = False

    def _gradients(self, out, scale, loss):
        step = self.step + 1
        self.reducer.finish(out, step)
        grads, finite = self.reducer.gradients(self.comm.size * scale)
        stop = bool(self.stop_flag is not None and self.stop_flag.requested)
        totals = self.comm.allreduce_sum(
            np.array([loss, 0.0 if finite else 1.0, 1.0 if stop else 0.0], np.float64), step,
            "the loss/overflow all-reduce")
        self._agreed_stop = bool(totals[2] > 0)
        return float(totals[0] / self.comm.size), grads, bool(totals[1] == 0)

    def _stop_requested(self, stop) -> bool:
        return self._agreed_stop

    def train_step(self) -> dict:
        record = super().train_step()
        every = self.dist.check_every
        if every and self.step % every == 0:
            self.check_weights()
        return record

    def check_weights(self) -> None:
        crc = np.array([weights_checksum(self.params)], np.int64)
        every = self.comm.allgather(crc, self.step, "the weight checksum")[:, 0]
        different = [r for r in range(self.comm.size) if every[r] != every[0]]
        if different:
            raise GraphoptError(f"weights differ across ranks after step {self.step}: rank(s) "
                                f"{different} disagree with rank 0 (CRC32 of all weights)")

    def run(self):
        self.broadcast_weights()
        return super().run()

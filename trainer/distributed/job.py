"""Job control for ``graphopt run --distributed``: launch (settings, the world communicator,
one GPU per rank), ranks (global and per host) and failures (every collective waits with a
deadline; past it the ranks ask each other who is missing, name the silent ones and abort the
job; an error on one rank aborts the job at once).

Every copy reads its rank and the world size from MPI itself (``MPI.COMM_WORLD``), never from
launcher variables. The small control collectives (the loss/overflow agreement, rank 0's
weights, the checkpoint broadcast, the settings check) go through :class:`Communicator`;
gradient buckets go through a transport (:mod:`.transport`).
"""
from __future__ import annotations

import math
import os
import pickle
import socket
import sys
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from graphopt.errors import GraphoptError

EXIT_TIMEOUT = 124          # a rank missed a deadline: the job is aborted with this status
EXIT_ERROR = 1              # a rank raised an error: the job is aborted with this status
SETUP_TIMEOUT_MIN = 60.0    # start-up collectives wait at least this long (imports, graph build)
MIB = 1 << 20
ABORT_GRACE = 0.5           # seconds between the error message and MPI_Abort


@dataclass
class DistSettings:
    bucket_mb: float = 25.0         # MiB of gradients per all-reduce bucket (bucket dtype)
    timeout: float = 300.0          # seconds any collective may wait for the other ranks
    check_every: int = 0            # compare weight checksums every K steps (0: never)
    overlap: bool = True            # start bucket all-reduces during the backward pass

    def validate(self) -> None:
        if not (math.isfinite(self.bucket_mb) and self.bucket_mb > 0):
            raise GraphoptError(f"--bucket-mb must be a positive number of MiB, not "
                                f"{self.bucket_mb:g}")
        if not self.timeout > 0:   # inf: wait for ever
            raise GraphoptError(f"--dist-timeout must be positive, not {self.timeout:g}")
        if self.check_every < 0:
            raise GraphoptError(f"--dist-check-every must be >= 0, not {self.check_every}")

    @property
    def bucket_bytes(self) -> int:
        """Bytes per bucket: at least 1; a bucket over 1 TiB is as good as one for all."""
        return max(1, int(min(self.bucket_mb, float(MIB)) * MIB))


class RefusedOnEveryRank(GraphoptError):
    """A refusal that every rank of the job reaches alike, at the same point, before any
    rank waits on another (the settings; the global batch against the number of ranks):
    rank 0 reports it in one line, the other ranks exit 1 quietly, and nobody aborts the
    job, so the user reads one line instead of every rank's copy and MPI_Abort's."""


def check_global_batch(batch_size: int, ranks: int) -> None:
    """``--batch-size`` is the global batch: it must split evenly across the ranks. Every
    rank decides alike, so the refusal is one line from rank 0 (:class:`RefusedOnEveryRank`)."""
    if batch_size % ranks:
        raise RefusedOnEveryRank(f"--batch-size {batch_size} is the global batch; it must be "
                                 f"divisible by the {ranks} ranks (e.g. --batch-size "
                                 f"{max(ranks, batch_size - batch_size % ranks)})")


def _world_rank() -> int | None:
    """This process's rank in MPI_COMM_WORLD (no collective: MPI_Init and a local query);
    None where there is no MPI."""
    try:
        return int(import_mpi().COMM_WORLD.Get_rank())
    except GraphoptError:
        return None


def refuse_on_every_rank(exc: GraphoptError):
    """Refuse ``exc``, which every rank raises alike: rank 0 raises it (as a
    :class:`RefusedOnEveryRank`), the others exit 1 without a word."""
    if _world_rank():
        raise SystemExit(EXIT_ERROR)
    if isinstance(exc, RefusedOnEveryRank):
        raise exc
    raise RefusedOnEveryRank(str(exc)) from None


def import_mpi():
    try:
        from mpi4py import MPI  # noqa: PLC0415  (initializes MPI on first import)
    except ImportError as exc:
        raise GraphoptError(f"--distributed needs mpi4py and an MPI library ({exc}); install "
                            "them with: pip install 'graphopt[distributed]' (mpi4py + the "
                            "mpich wheel, which provides mpiexec)") from None
    return MPI


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
        """An error on this rank: say so and abort the job (the others would only wait).
        A :class:`RefusedOnEveryRank` aborts nothing, every rank stops on its own: the
        others exit 1 quietly here, rank 0 returns and its caller raises the error."""
        if isinstance(exc, RefusedOnEveryRank):
            if self.rank != 0:
                raise SystemExit(EXIT_ERROR) from None
            return
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
    # the GradientReducer (sub)class the trainer uses; None: the standard one (a test passes
    # a subclass that injects faults)
    reducer_class: type | None = None

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
          check_every: int | None = None, overlap: bool | None = None, *,
          batch_size: int | None = None) -> Distributed | None:
    """The job's communicator for ``--distributed`` (None without it).

    The settings, and ``batch_size`` (the global batch, when it is known here) against the
    number of ranks, are checked before the ranks do any collective work, alike on every
    rank: a refusal is one line from rank 0 (:func:`refuse_on_every_rank`)."""
    given = {"--bucket-mb": bucket_mb, "--dist-timeout": timeout,
             "--dist-check-every": check_every, "--dist-overlap/--no-dist-overlap": overlap}
    if not enabled:
        named = [name for name, value in given.items() if value is not None]
        if named:
            raise GraphoptError(f"{', '.join(named)} only apply with --distributed")
        return None
    try:
        settings = _settings(bucket_mb, timeout, check_every, overlap)
        if batch_size is not None and batch_size >= 1:   # Batches refuses the others
            check_global_batch(batch_size, import_mpi().COMM_WORLD.Get_size())
    except GraphoptError as exc:
        refuse_on_every_rank(exc)
    return Distributed(world(settings.timeout), settings)


def _settings(bucket_mb, timeout, check_every, overlap) -> DistSettings:
    defaults = DistSettings()
    values = {}
    for option, value, default, kind in (("--bucket-mb", bucket_mb, defaults.bucket_mb, float),
                                         ("--dist-timeout", timeout, defaults.timeout, float),
                                         ("--dist-check-every", check_every,
                                          defaults.check_every, int)):
        try:
            values[option] = default if value is None else kind(value)
        except (TypeError, ValueError, OverflowError):
            raise GraphoptError(f"{option} must be a number, not {value!r}") from None
    settings = DistSettings(values["--bucket-mb"], values["--dist-timeout"],
                            values["--dist-check-every"],
                            defaults.overlap if overlap is None else bool(overlap))
    settings.validate()
    return settings

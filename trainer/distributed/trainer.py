"""The data-parallel trainer: :class:`~..loop.Trainer` with the distributed hooks (sharded
data, bucketed gradient all-reduce, agreed loss/overflow/stop, rank 0's weights and
checkpoints)."""
from __future__ import annotations

import zlib
from collections.abc import Mapping

import numpy as np

from graphopt.errors import GraphoptError

from .. import checkpoint as ckpt
from ..loop import Trainer
from ..optimizers import to_host
from .buckets import GradientReducer
from .job import MIB, SETUP_TIMEOUT_MIN, Communicator, DistSettings
from .transport import make_transport


def fingerprint(trainer: Trainer, scaler_spec) -> str:
    """What must be the same on every rank (compared as a CRC at the start)."""
    scalars, _ = trainer.optimizer.state()
    scalars = {k: v for k, v in scalars.items() if k != "steps"}
    shapes = [(n, tuple(v.shape), str(v.dtype)) for n, v in trainer.params.items()]
    return repr((trainer.settings.total_steps, trainer.settings.precision, trainer.settings.seed,
                 trainer.batches.batch_size, trainer.batches.size, trainer.batches.seed,
                 sorted(scalars.items()), scaler_spec, shapes))


def weights_checksum(params: Mapping[str, np.ndarray]) -> int:
    """CRC32 of all weights (device weights are read back: ``--dist-check-every`` steps
    only)."""
    crc = 0
    for value in params.values():
        crc = zlib.crc32(np.ascontiguousarray(to_host(value)).view(np.uint8), crc)
    return crc


class DistributedTrainer(Trainer):
    """:class:`~..loop.Trainer` with the data-parallel hooks; rank 0 writes checkpoints.

    With a device transport (NCCL/RCCL) the weights, gradients, buckets and optimizer state
    stay on the GPU, as in a single-GPU run: a step reads back one small array, the losses
    and this rank's finite flag together (:meth:`_reduce_on_device`), then agrees on them over
    MPI. With MPI the buckets are summed through the host and the weights stay there."""

    weights_on_device = False  # decided once the transport is known (see __init__)

    def __init__(self, *args, comm: Communicator, dist: DistSettings, transport=None,
                 reducer_class: type | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.comm, self.dist = comm, dist
        # ``transport``: chosen by make_transport unless given (tests hand in their own)
        self.transport = transport or make_transport(comm, self.session.backend)
        if getattr(self.transport, "device_resident", False) \
                and getattr(self.session.backend, "is_gpu", False):
            self._on_device = True
            self.params = self._placed(self.params)
        self._device_step: tuple | None = None   # (scale, gradients, finite) of this step
        self.reducer = (reducer_class or GradientReducer)(
            self, comm, self.transport, dist.bucket_bytes, dist.overlap)
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
            host = to_host(value) if self._on_device else value   # once, at the start
            if not host.flags.c_contiguous:
                host = np.ascontiguousarray(host)
            self.comm.bcast_array(host, self.step, "the broadcast of rank 0's weights",
                                  self.setup_timeout)
            self.params[name] = self._placed({name: host})[name]

    def _read_checkpoint(self, directory: str, check: ckpt.Check) -> ckpt.Checkpoint:
        state: object
        if self.comm.rank == 0:
            try:
                state = ckpt.load(directory, check)
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
        self._next_weight_generation(feeds)
        self.reducer.begin()
        try:
            out = self.session.run(feeds, self.fetches, on_step=self.reducer.step_hook,
                                   to_host=not self._on_device)
        finally:
            self.reducer.end()
        return self._reduce_on_device(out) if self._on_device else out

    def _reduce_on_device(self, out: dict) -> dict:
        """Finish the device all-reduces, unscale on the device, and read back the losses and
        this rank's finite flag as one array: the step's only device->host copy. The losses
        come back as host arrays of their own dtype and shape (exact through float64)."""
        xp = self.session.backend.xp
        scale = self.scaler.scale   # the scale this step was fed (train_step read the same)
        self.reducer.finish(out, self.step + 1)
        grads, finite = self.reducer.gradients(self.comm.size * scale)
        losses = [out[name] for name in self.graph.losses]
        packed = xp.concatenate([xp.reshape(v, (-1,)).astype(np.float64) for v in losses]
                                + [xp.reshape(finite, (1,)).astype(np.float64)])
        host = self.session.backend.to_host(packed)
        out = dict(out)
        position = 0
        for name, value in zip(self.graph.losses, losses, strict=True):
            out[name] = host[position:position + value.size].astype(value.dtype).reshape(
                value.shape)
            position += value.size
        self._device_step = (scale, grads, bool(host[-1]))
        return out

    def _gradients(self, out, scale, loss):
        step = self.step + 1
        if self._on_device:
            done, self._device_step = self._device_step, None
            if done is None or done[0] != scale:
                raise GraphoptError("internal error: the device all-reduce did not run for "
                                    "this step with its loss scale")
            grads, finite = done[1], done[2]
        else:
            self.reducer.finish(out, step)
            grads, finite = self.reducer.gradients(self.comm.size * scale)
        stop = bool(self.stop_flag is not None and self.stop_flag.requested)
        totals = self.comm.allreduce_sum(
            np.array([loss, 0.0 if finite else 1.0, 1.0 if stop else 0.0], np.float64), step,
            "the loss/overflow all-reduce")
        self._agreed_stop = bool(totals[2] > 0)
        return float(totals[0] / self.comm.size), grads, bool(totals[1] == 0)

    def _accumulator(self, grads: dict) -> dict:
        # the reducer's buckets take the next micro-batch's gradients
        return {name: grad.copy() for name, grad in grads.items()}

    def _update_buffers(self, out: dict) -> None:
        """Rank 0's running statistics on every rank, as DistributedDataParallel broadcasts
        its buffers (each rank's own batch share would give each its own)."""
        super()._update_buffers(out)
        for name, value in self.buffers.items():
            host = np.ascontiguousarray(to_host(value))
            self.comm.bcast_array(host, self.step + 1, "the broadcast of rank 0's running "
                                  "statistics")
            self.buffers[name] = self._placed({name: host})[name]

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

"""Gradient bucketing: the gradients packed into a few contiguous buckets (float32 on the host
for MPI; on the device in the gradients' own dtype for NCCL) in the order the backward pass
produces them, each all-reduced as soon as its last gradient exists."""
from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from graphopt.errors import GraphoptError

from ..loop import Trainer
from .job import Communicator


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
                 produced_at: Mapping[str, float], bucket_bytes: int,
                 itemsize: int = 4) -> list[Bucket]:
    """Parameters in the order their gradients are produced (ties: model order), packed
    greedily into buckets of at most ``bucket_bytes`` bytes of ``itemsize``-byte elements
    (a larger gradient gets a
    bucket of its own; gradients no planned step produces get buckets of their own, so they
    do not hold back the others); a bucket is ready when its last gradient is produced."""
    order = sorted(params, key=lambda p: (produced_at.get(p, math.inf), params.index(p)))
    buckets: list[Bucket] = []
    current: Bucket | None = None
    for name in order:
        size = int(np.prod(shapes[name], dtype=np.int64))
        late = produced_at.get(name, math.inf) == math.inf   # filled after the run
        if current is None or (current.numel and (current.numel + size) * itemsize > bucket_bytes) \
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

    How the overlap works: the trainer passes :attr:`step_hook` to ``Session.run(on_step=...)``,
    which calls it after each step of the plan of the training fetches with the step's output
    values. After a step that produces a gradient, the gradient is copied into its bucket;
    a bucket whose last gradient just arrived starts its non-blocking all-reduce; every later
    step pokes the pending requests (MPI progresses only when called; NCCL needs no poke).
    With ``overlap=False``, or for gradients no planned step produces, the buckets are filled
    and reduced after the run (:meth:`finish`).
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
        # the gradients come in the compute dtype; a device transport keeps it (FP16 buckets
        # under mixed/fp16 precision), MPI sums float32
        grad_dtype = np.dtype(getattr(trainer, "compute_dtype", np.float32))
        bucket_dtype = getattr(transport, "bucket_dtype", lambda _: np.dtype(np.float32))
        self.dtype = np.dtype(bucket_dtype(grad_dtype))
        self.buckets = plan_buckets(list(graph.params), shapes, produced_at, bucket_bytes,
                                    self.dtype.itemsize)
        self.slots: dict[str, list[tuple[Bucket, int, int]]] = {}
        for bucket in self.buckets:
            bucket.buffer = transport.buffer(bucket.numel, self.dtype)
            for name, offset, size in zip(bucket.params, bucket.offsets, bucket.sizes,
                                          strict=True):
                self.slots.setdefault(self.grad_of[name], []).append((bucket, offset, size))
        self.active = False
        self.pending: list = []
        self.launched = self.launched_in_backward = 0   # bucket all-reduces, all / overlapped
        self.gradient_bytes = sum(b.numel for b in self.buckets) * self.dtype.itemsize
        # what to do after plan step i: stage (output position, gradient), start buckets
        self.taps: dict[int, list[tuple[int, str]]] = {}
        self.ready: dict[int, list[Bucket]] = {}
        for bucket in self.buckets:
            if bucket.ready_at != math.inf:
                self.ready.setdefault(int(bucket.ready_at), []).append(bucket)
        for index, step in enumerate(plan.steps):
            taps = [(position, out) for position, out in enumerate(step.node.outputs)
                    if out in self.slots]
            if taps:
                self.taps[index] = taps

    @property
    def step_hook(self):
        """The ``on_step`` callback for ``Session.run`` (None: nothing to overlap)."""
        return self.after_step if self.overlap and self.ready else None

    def after_step(self, index: int, node, outputs: tuple) -> None:
        """Plan step ``index`` ran: stage the gradients it produced, start the buckets they
        complete, and poke the all-reduces in flight."""
        if not self.active:
            return
        for position, name in self.taps.get(index, ()):
            self.stage(name, outputs[position])
        for bucket in self.ready.get(index, ()):
            self.launch(bucket)
        if self.pending:
            self.transport.poke(self.pending)

    # -- one step ---------------------------------------------------------------------------
    def begin(self) -> None:
        for bucket in self.buckets:
            bucket.staged.clear()
            bucket.handle = None
        self.pending = []
        self.active = self.overlap

    def end(self) -> None:
        """The executor run is over (or failed): the hook acts no more."""
        self.active = False

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
        self.end()
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

    def gradients(self, divisor: float) -> tuple[dict[str, np.ndarray], object]:
        """Averaged, unscaled float32 gradients (views of the buckets) and their finiteness
        on this rank: a bool for a host transport; for a device transport the gradients stay
        on the device and the flag is a device bool not yet read back."""
        grads: dict[str, np.ndarray] = {}
        flags = []
        for bucket in self.buckets:
            summed, ok = self.transport.finish(bucket.buffer, divisor)
            flags.append(ok)
            for name, offset, size, shape in zip(bucket.params, bucket.offsets, bucket.sizes,
                                                 bucket.shapes, strict=True):
                grads[name] = summed[offset:offset + size].reshape(shape)
        if flags and getattr(self.transport, "device_resident", False):
            xp = self.transport.xp
            return grads, xp.all(xp.stack([xp.reshape(f, (1,)) for f in flags]))
        return grads, all(flags)

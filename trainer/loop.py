"""The training loop: one executor run per step (forward, YieldOp, backward under the
guard), then loss-scale bookkeeping and the optimizer update on the master weights.

Non-finite values: a step whose loss or gradients hold a NaN/Inf never updates the weights.
The step's feeds are run again through the session fetching every tensor, and the first node
(in execution order) whose output is non-finite is named, with its op type and whether an
input was already non-finite (:func:`locate_nonfinite`). With dynamic loss scaling the step is
skipped and counted, like a gradient overflow, and the first step of each kind (loss,
gradients) is reported in one line; without it, training stops with a
:class:`NonFiniteError` naming the step and the node, and nothing of that step is saved:
the last checkpoint stays the last good state. In a distributed run the loss and the
overflow flag are agreed across ranks before this decision, so every rank decides alike.
"""
from __future__ import annotations

import contextlib
import math
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import onnx

from graphopt.errors import GraphoptError, Terminated
from graphopt.executor import ExecutorError, blas_threads
from graphopt.executor.memory import human as memory_human
from graphopt.executor.memory import memory_owner
from graphopt.executor.numerics import WeightGeneration

from . import checkpoint as ckpt
from .data import Batches
from .history import DEFAULT_CAPACITY, History
from .loss_scaling import LossScaler
from .metrics import classification_of, correct_and_counted, perplexity
from .optimizers import Optimizer, to_host
from .precision import compute_dtype, master_dtype
from .progress import Progress, StepLog
from .schedule import clip_coefficient, lr_factor
from .training_graph import RunGraph


@dataclass
class LoopSettings:
    total_steps: int
    precision: str = "fp32"
    seed: int = 0
    checkpoint_dir: str | None = None
    checkpoint_every: int | None = None   # steps; None: at the end of every epoch
    interrupt_dir: str | None = None      # Ctrl-C without --checkpoint saves in this run's
    #                                       own folder under it (checkpoint.claim_run_folder)
    run_settings: dict = field(default_factory=dict)   # saved in checkpoints (bare --resume)
    lr_schedule: str = "constant"         # see .schedule
    warmup: int = 0
    clip_grad_norm: float | None = None   # max global L2 norm of the gradients
    eval_every: int | None = None         # steps; None: at the end of every epoch
    allow_changed_graph: bool = False     # resume a checkpoint of another training graph
    history_rows: int = DEFAULT_CAPACITY  # the loss history's bound (see .history)


@dataclass
class TrainResult:
    params: dict[str, np.ndarray]         # float32 copies of the master weights
    history: History = field(default_factory=History)
    steps_done: int = 0
    skipped: int = 0
    interrupted: bool = False
    checkpoint: str | None = None         # path of the last checkpoint written
    nonfinite: dict[str, int] = field(default_factory=dict)   # skipped steps per kind
    stop_signal: int | None = None        # SIGINT or SIGTERM when interrupted
    buffers: dict[str, np.ndarray] = field(default_factory=dict)   # running statistics

    @property
    def losses(self) -> list[float]:
        return self.history.losses


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class StopFlag:
    """Ctrl-C or SIGTERM asks the loop to stop after the current step (and checkpoint); a
    second one of either aborts at once (KeyboardInterrupt, or Terminated for SIGTERM)."""

    def __init__(self):
        self.requested = False
        self.signum: int | None = None    # the signal that asked first
        self._previous: dict[int, object] = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for signum in STOP_SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def _handle(self, signum, frame):
        if self.requested:
            raise Terminated if signum == signal.SIGTERM else KeyboardInterrupt
        self.requested = True
        self.signum = signum

    def __exit__(self, *exc):
        for signum, previous in self._previous.items():
            if previous is not None:   # None: set outside Python, cannot be put back
                signal.signal(signum, previous)
        self._previous = {}


class NonFiniteError(GraphoptError):
    """A NaN/Inf loss or gradient without dynamic loss scaling: training stops, nothing of
    the step is applied or saved. Raised alike on every rank of a distributed run.
    ``finding`` is the part about the step and the node, without where the state is."""

    def __init__(self, message: str, finding: str = ""):
        super().__init__(message)
        self.finding = finding or message


def _nonfinite(value) -> str | None:
    """"nan" / "inf" / "-inf" if a float array holds such a value, else None."""
    if value is None:
        return None
    array = to_host(value)
    if not np.issubdtype(array.dtype, np.floating) or array.size == 0:
        return None
    with np.errstate(invalid="ignore", over="ignore"):
        if np.isfinite(array).all():
            return None
        if np.isnan(array).any():
            return "nan"
        return "inf" if (array == np.inf).any() else "-inf"


def _holds(value, kind: str) -> bool:
    array = to_host(value)
    if not np.issubdtype(array.dtype, np.floating) or array.size == 0:
        return False
    with np.errstate(invalid="ignore"):
        if kind == "nan":
            return bool(np.isnan(array).any())
        return bool((array == (np.inf if kind == "inf" else -np.inf)).any())


class _ConstantOrigins:
    """Which tensors of a graph are computed from initializers and Constant nodes alone (no
    data, no trained weight fed): a mask constant, not a fault of the step."""

    def __init__(self, graph):
        self.producers = {out: node for node in graph.node for out in node.output}
        fed = {i.name for i in graph.input}
        self.leaves = {t.name for t in graph.initializer} - fed
        self.memo: dict[str, bool] = {}

    def __call__(self, name: str) -> bool:
        if name not in self.memo:
            self.memo[name] = False   # a cycle is no constant
            node = self.producers.get(name)
            self.memo[name] = name in self.leaves if node is None else \
                all(self(i) for i in node.input if i)
        return self.memo[name]


def locate_nonfinite(session, feeds: dict, weights=(), kind: str | None = None) -> str | None:
    """Run ``feeds`` again fetching every tensor; name the first node (in plan order) whose
    output holds a NaN/Inf (of ``kind``, the fault's own, "nan"/"inf"/"-inf", where given
    and found: a float16 attention mask's intended -inf is not the NaN's cause): its op
    type, name, and any input that was already non-finite. None when every tensor is finite
    this time (the fault came from elsewhere: another rank's batch in a data-parallel run).
    Holds every tensor of the step at once: a model that would not fit so gets a line
    saying the node could not be located."""
    graph = session.model.graph
    names: list[str] = []
    seen: set[str] = set()
    for node in graph.node:
        for name in (*node.input, *node.output):
            if name and name not in seen:
                seen.add(name)
                names.append(name)
    try:
        plan = session.plan(names)
        with np.errstate(all="ignore"):
            values = session.run(feeds, names)
    except (ExecutorError, MemoryError) as exc:
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return f"the step could not be run again to find the node ({first[:160]})"
    inputs = set(session.input_names)
    from_constants = _ConstantOrigins(graph)
    for wanted in ([kind] if kind else []) + [None]:
        for step in plan.steps:
            node = step.node
            bad = [(out, found) for out in node.outputs
                   if (found := _nonfinite(values.get(out)))
                   and (wanted is None or _holds(values[out], wanted))]
            if not bad:
                continue
            out, found = bad[0]
            found = wanted or found
            where = f"{node.op_type} node {node.name!r}"
            if len(node.outputs) > 1:
                where += f" (output {out!r})"
            already = [(name, k) for name in node.inputs
                       if name and (k := _nonfinite(values.get(name, feeds.get(name))))]
            if already:
                name, k = already[0]
                origin = (", a weight" if name in weights else
                          ", from the data" if name in inputs else
                          ", from constants alone (float32's most negative values, an "
                          "attention mask's, are -inf in float16)"
                          if k == "-inf" and from_constants(name) else "")
                detail = f"input {name!r} was already {k}{origin}"
            else:
                detail = "inputs finite"
            return f"first non-finite value ({found}) produced by {where} ({detail})"
    return None


def resident_bytes() -> int | None:
    """This process's resident set (Linux's /proc; None elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE")


def own_gradient(value, taken: set[int]):
    """A gradient as a float32 array the step may scale in place (loss scale, clipping): the
    run's output itself when it is one (no copy of every gradient), else a copy: another
    dtype, a read-only view (a broadcast zero), or memory in ``taken`` (the ids of buffers
    that are not the step's to change: the feeds, the session's constants, the gradients
    taken so far)."""
    grad = value.astype(np.float32, copy=False)
    writable = getattr(getattr(grad, "flags", None), "writeable", True)
    if grad is value and (not writable or id(memory_owner(grad)) in taken):
        grad = grad.copy()
    taken.add(id(memory_owner(grad)))
    return grad


def eval_words(record: dict) -> str:
    """``eval loss 2.1234 (perplexity 8.37, accuracy 41.2%)`` of a record with an evaluation."""
    words = f"eval loss {record['eval_loss']:.4f}"
    if "eval_accuracy" in record:
        words += (f" (perplexity {record['eval_perplexity']:.4g}, accuracy "
                  f"{100 * record['eval_accuracy']:.1f}%)")
    return words


def _reseed(session, value: int) -> None:
    """Dropout masks of step N depend on (seed, N) only: a resumed run draws the same."""
    session.reseed(value)


class Trainer:
    weights_on_device = True

    def __init__(self, graph: RunGraph, session, batches: Batches, optimizer: Optimizer,
                 scaler: LossScaler, settings: LoopSettings, *, progress: Progress | None = None,
                 log: StepLog | None = None, echo: Callable[[str], None] = print,
                 after_step: Callable[[int, dict], None] | None = None,
                 warn: Callable[[str], None] | None = None):
        self.graph, self.session, self.batches = graph, session, batches
        self.optimizer, self.scaler, self.settings = optimizer, scaler, settings
        self.progress, self.log, self.echo, self.after_step = progress, log, echo, after_step
        self.warn = warn   # the one-line report of a skipped non-finite step (None: silent)
        self.compute_dtype = compute_dtype(settings.precision)
        # On a GPU the weights, their gradients and the optimizer state stay on the device:
        # a step copies the loss and one finite flag back, nothing else (a distributed
        # trainer all-reduces through the host and keeps them there).
        backend = getattr(session, "backend", None)
        self._on_device = self.weights_on_device and bool(getattr(backend, "is_gpu", False))
        # the BLAS threads of the large products on the CPU (a checkpoint records them: another
        # count can move a product's last bits, and a resumed run takes the checkpoint's)
        self.blas_threads = None if getattr(backend, "is_gpu", False) \
            else blas_threads.thread_count()
        # the starting values themselves where the master dtype is theirs (float32): the
        # optimizer updates them in place
        self.params = self._placed({n: v.astype(master_dtype(settings.precision), copy=False)
                                    for n, v in graph.initial.items()})
        # state a step updates without a gradient (BatchNorm's running statistics), float32;
        # each step is fed them and replaces them by the graph's updates
        self.buffers = self._placed({n: v.astype(np.float32, copy=False)
                                     for n, v in graph.buffers.items()})
        self.history = History(settings.history_rows)
        self.step = 0
        self.fetches = list(graph.losses) + [graph.grads[p] for p in graph.params] \
            + list(graph.buffer_updates.values())
        self._loss_feeds = self._loss_gradient_templates()
        # a mean cross-entropy: perplexity every step, accuracy on held-out data
        self.classification = classification_of(graph.proto, graph.losses)
        self._last_checkpoint: str | None = None
        self._checkpoint_step: int | None = None    # step of the last checkpoint in place
        self.nonfinite: dict[str, int] = {}       # skipped non-finite steps per kind
        self._reported: set[str] = set()          # kinds already reported in this process
        self.stop_flag: StopFlag | None = None   # set while run() runs
        self.eval_batches: list[dict] = []        # --eval-data, cut into batches
        # the emulated FP16 alternate converts each weight once per step, not once per GEMM
        self.weight_generation = WeightGeneration()
        self._not_ours: set[int] = set()   # see _run_graph
        # the session's constants' buffers (a gradient output may view one): fixed
        constants = getattr(session, "constant_buffers", None)
        self._constants = frozenset(constants()) if constants is not None else frozenset()
        numerics = getattr(session, "numerics", None)
        if hasattr(numerics, "cache_weights"):
            numerics.cache_weights(self.weight_generation)

    # -- setup --------------------------------------------------------------------------------
    def _placed(self, params: dict) -> dict:
        if not self._on_device:
            return params
        return {n: self.session.backend.to_device(v) for n, v in params.items()}

    def _loss_gradient_templates(self) -> list[tuple[str, tuple, np.dtype]]:
        """(YieldOp output, shape, dtype) of each loss: fed ``scale`` when scaling."""
        declared = {o.name: o for o in self.graph.proto.graph.output}
        templates = []
        for loss, grad in zip(self.graph.losses, self.graph.loss_grads, strict=False):
            tensor_type = declared[loss].type.tensor_type if loss in declared else None
            dims = None
            if tensor_type is not None and tensor_type.HasField("shape"):
                dims = [d.dim_value if d.HasField("dim_value") else None
                        for d in tensor_type.shape.dim]
            dtype = np.dtype(np.float32)
            if tensor_type is not None and tensor_type.elem_type:
                dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor_type.elem_type))
            templates.append((grad, None if dims is None or None in dims else tuple(dims), dtype))
        return templates

    def _read_checkpoint(self, directory: str, check: ckpt.Check) -> ckpt.Checkpoint:
        """Hook: a distributed run reads on rank 0 and broadcasts."""
        return ckpt.load(directory, check)

    def resume_from(self, directory: str) -> None:
        # checked on the arrays' headers before any is decompressed, then again on the arrays
        state = self._read_checkpoint(directory,
                                      lambda declared: self._check_fits(directory, declared))
        self._check_fits(directory, state)
        self.optimizer.load_state(state.optimizer, state.optimizer_arrays)
        self.scaler.load_state(state.scaler)
        self.buffers.update(self._placed({n: v.astype(np.float32, copy=False)
                                          for n, v in state.buffers.items()}))
        dtype = master_dtype(self.settings.precision)
        for name, value in state.params.items():
            mine = self.params[name]
            if isinstance(mine, np.ndarray) and mine.flags.writeable:
                mine[...] = value   # into the weights' own memory: no second copy of them
            else:
                self.params[name] = self._placed({name: value.astype(dtype)})[name]
        self.step = state.step
        self.history = History(self.settings.history_rows, state.history, state.history_stride,
                               state.first_loss)
        self.nonfinite = dict(state.nonfinite)
        if state.blas_threads and self.blas_threads and state.blas_threads != self.blas_threads:
            if self.warn is not None:   # (not with -q)
                self.warn(f"resuming on {state.blas_threads} BLAS threads, as the checkpoint's "
                          f"run (this process has {self.blas_threads}): another count can "
                          "move a product's last bits")
            self.blas_threads = state.blas_threads
        self._last_checkpoint = ckpt.path_in(directory)
        self._checkpoint_step = state.step

    def _check_fits(self, directory: str, state: ckpt.Checkpoint) -> None:
        """That ``state`` continues this run: the same weights (names, shapes), training
        graph, precision, data and optimizer slots. Its arrays may be headers only
        (:class:`checkpoint.Declared`): nothing here reads their values."""
        if list(state.params) != list(self.params):
            raise GraphoptError(f"checkpoint in {directory} trains {list(state.params)[:4]}..., "
                                f"this run trains {list(self.params)[:4]}...; not the same model")
        for name, value in state.params.items():
            if value.shape != self.params[name].shape:
                raise GraphoptError(f"checkpoint weight {name!r} has shape {value.shape}, the "
                                    f"model's is {self.params[name].shape}")
        mine = {n: tuple(v.shape) for n, v in self.buffers.items()}
        theirs = {n: tuple(v.shape) for n, v in state.buffers.items()}
        if theirs != mine:
            raise GraphoptError(f"checkpoint in {directory} holds the running statistics "
                                f"{sorted(theirs)[:4]}, this run updates {sorted(mine)[:4]} "
                                "(names and shapes differ); not the same model")
        if state.graph != (self.graph.fingerprint or None) \
                and not self.settings.allow_changed_graph:
            what = ("does not record which training graph it was written for (an older "
                    "graphopt wrote it)" if state.graph is None else
                    "was written for another training graph (the same weight names and "
                    "shapes, but other nodes, constants, frozen weights or loss)")
            raise GraphoptError(f"checkpoint in {directory} {what}; resume with the model and "
                                "--loss it was trained with, or pass --allow-changed-graph to "
                                "continue training these weights in this graph")
        if state.precision != self.settings.precision:
            raise GraphoptError(f"checkpoint was trained with --precision {state.precision}, "
                                f"this run asks for {self.settings.precision}")
        data = state.data
        mine = {"seed": self.batches.seed, "size": self.batches.size,
                "batch_size": self.batches.batch_size, "accumulate": self.batches.accumulate}
        data = {"accumulate": 1, **data}   # written before gradient accumulation existed
        for key, value in mine.items():
            if data.get(key) != value:
                raise GraphoptError(f"checkpoint data {key} is {data.get(key)}, this run has "
                                    f"{value}; resume with the same data, --seed, --batch-size "
                                    "and --grad-accum")
        self.optimizer.check_arrays(state.optimizer_arrays, state.optimizer.get("steps", 0),
                                    state.params)

    # -- checkpoints ----------------------------------------------------------------------
    def save_checkpoint(self, directory: str) -> str:
        epoch, index = self.batches.position(self.step)
        scalars, arrays = self.optimizer.state()
        state = ckpt.Checkpoint(
            step=self.step, params={n: to_host(v) for n, v in self.params.items()},
            buffers={n: to_host(v) for n, v in self.buffers.items()},
            optimizer=scalars, optimizer_arrays=arrays,
            scaler=self.scaler.state(),
            data={"seed": self.batches.seed, "size": self.batches.size,
                  "batch_size": self.batches.batch_size,
                  "accumulate": self.batches.accumulate, "epoch": epoch,
                  "batch_in_epoch": index},
            history=list(self.history), history_stride=self.history.stride,
            first_loss=self.history.first_loss, nonfinite=dict(self.nonfinite),
            precision=self.settings.precision,
            settings=self.settings.run_settings,
            graph=self.graph.fingerprint or None, blas_threads=self.blas_threads)
        self._last_checkpoint = ckpt.save(directory, state)
        self._checkpoint_step = self.step
        return self._last_checkpoint

    def _checkpoint_due(self) -> bool:
        every = self.settings.checkpoint_every
        if every:
            return self.step % every == 0
        return self.step % self.batches.steps_per_epoch == 0

    # -- one step -------------------------------------------------------------------------
    def _micro_step(self, feeds: dict, scale: float, seed: int
                    ) -> tuple[float, dict[str, np.ndarray], bool, dict]:
        """Forward and backward on one (micro-)batch: (loss, unscaled gradients, finite,
        the graph's outputs); the running statistics it computed become the next
        micro-batch's (train_step puts the step's first ones back if the step is skipped)."""
        for name, value in (*self.params.items(), *self.buffers.items()):
            feeds[name] = value.astype(self.compute_dtype, copy=False)
        if scale != 1.0:
            for grad_name, shape, dtype in self._loss_feeds:
                if shape is None:
                    raise GraphoptError("loss scaling needs losses of known static shape; "
                                        "use --loss-scale none")
                feeds[grad_name] = np.full(shape, scale, dtype)
        _reseed(self.session, seed)
        # FP16 overflow is expected while a loss scale searches for its level: the step is
        # detected below and skipped, so numpy's warnings about it are noise
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            out = self._run_graph(feeds)
        loss = float(sum(np.sum(out[name], dtype=np.float64) for name in self.graph.losses))
        loss, grads, finite = self._gradients(out, scale, loss)
        if finite and math.isfinite(loss):
            self._update_buffers(out)
        return loss, grads, finite, out

    def train_step(self) -> dict:
        started = time.perf_counter()
        step = self.step
        scale = self.scaler.scale
        micro_batches = self.batches.micro_batches(step)
        seed = self.settings.seed * 1_000_003 + step
        statistics = dict(self.buffers)   # the running statistics a skipped step keeps
        loss, grads, finite, out = self._micro_step(micro_batches[0], scale, seed)
        feeds = micro_batches[0]   # the (first) micro-batch a fault report runs again
        if len(micro_batches) > 1:
            # gradient accumulation: the mean of the micro-batches' gradients and losses, as
            # transformers' Trainer divides each micro-batch's loss by their count
            total = loss
            grads = self._accumulator(grads)
            for micro, batch in enumerate(micro_batches[1:], start=1):
                out.clear()
                part, more, part_finite, out = self._micro_step(
                    batch, scale, seed * 1_000_003 + micro)
                if finite and not (part_finite and math.isfinite(part)):
                    feeds = batch
                total += part
                finite = finite and part_finite
                for name, grad in more.items():
                    grads[name] += grad
                self.session.recycle(more)
            count = np.float32(len(micro_batches))
            for grad in grads.values():
                grad /= count
            loss = total / len(micro_batches)
        # both are agreed across ranks in a distributed run: every rank decides alike
        kind = "loss" if not math.isfinite(loss) else None if finite else "gradients"
        scale_used = scale
        if kind is not None and not self.scaler.dynamic:
            finding = self._fault_message(step + 1, kind, loss, grads, feeds)
            raise NonFiniteError(f"{finding}; training stopped, the update was not applied "
                                 f"and {self._where_saved()}; --loss-scale dynamic would skip "
                                 "such steps instead", finding)
        applied = self.scaler.update(kind is not None)
        if kind is not None:
            self.buffers = statistics   # an earlier micro-batch's update goes too
            self.nonfinite[kind] = self.nonfinite.get(kind, 0) + 1
            if self.warn is not None and kind not in self._reported:
                self._reported.add(kind)
                self.warn(self._fault_message(step + 1, kind, loss, grads, feeds)
                          + f"; step skipped, loss scale {scale_used:g} -> "
                          f"{self.scaler.scale:g} (later non-finite {kind} steps are skipped "
                          "and counted, not reported)")
        settings = self.settings
        factor = lr_factor(settings.lr_schedule, step, settings.total_steps, settings.warmup)
        norm = None
        if settings.clip_grad_norm is not None and kind is None:
            norm = math.sqrt(sum(float(g.ravel() @ g.ravel()) for g in grads.values()))
            coefficient = clip_coefficient(norm, settings.clip_grad_norm)
            if coefficient < 1.0:
                for grad in grads.values():
                    grad *= np.float32(coefficient)
        if applied:
            self.optimizer.step(self.params, grads, factor)
        out.clear()  # the gradients' only other references
        self.session.recycle(grads)  # their memory serves the next step's gradients
        self.step += 1
        epoch, _ = self.batches.position(step)
        record = {"step": self.step, "epoch": epoch, "loss": loss,
                  **({"perplexity": perplexity(loss)} if self.classification else {}),
                  "loss_scale": scale_used,
                  "skipped": self.scaler.skipped, "applied": applied,
                  "seconds": round(time.perf_counter() - started, 6)}
        if settings.lr_schedule != "constant" or settings.warmup:
            record["lr"] = self.optimizer.lr * factor
        if norm is not None:
            record["grad_norm"] = norm
        if kind is not None:
            record["nonfinite"] = kind
        self.history.append(record)
        return record

    # -- memory -------------------------------------------------------------------------------
    def memory_plan(self) -> tuple[int, str]:
        """(the step's planned peak bytes, what it is made of in words): what the process
        holds now (the master weights, the session's constants, the interpreter, libraries
        and graphs: the resident set on the CPU), the optimizer's state (allocated at its
        first update), and the step's own tensors at their peak (activations kept for the
        backward pass, gradients, the compute-dtype copies of the weights, the batch), from
        the executor's plan. Kernels' scratch memory comes on top."""
        feeds = self.batches.batch(self.step)
        for name, value in self.params.items():
            feeds[name] = value.astype(self.compute_dtype, copy=False)
        run_peak, node = self.session.planned_peak(feeds, self.fetches)
        weights = sum(int(p.nbytes) for p in self.params.values())
        fed_copies = any(feeds[n] is not p for n, p in self.params.items())
        state = 0 if self.optimizer.slots else len(self.optimizer.slot_names) * sum(
            4 * int(p.size) for p in self.params.values())
        constants = self.session.constants_bytes()
        step_tensors = max(0, run_peak - constants - (0 if fed_copies else weights))
        human = memory_human
        resident = resident_bytes() if not self._on_device else None
        if resident is not None:
            held = resident
            parts = [f"this process now {human(resident)} (weights {human(weights)}, the "
                     f"interpreter, libraries and graph)"]
        else:
            held = weights + constants
            parts = [f"weights {human(weights)}"]
        if state:
            parts.append(f"optimizer state {human(state)}")
        where = f", at node {node!r}" if node else ""
        parts.append(f"the step's tensors {human(step_tensors)} (activations kept for the "
                     f"backward pass, gradients, batch{where})")
        total = held + state + step_tensors
        return total, f"planned peak memory about {human(total)}: " + " + ".join(parts)

    # -- evaluation ---------------------------------------------------------------------------
    def _eval_due(self) -> bool:
        if not self.eval_batches:
            return False
        every = self.settings.eval_every
        due = self.step % every == 0 if every else \
            self.step % self.batches.steps_per_epoch == 0
        return due or self.step == self.settings.total_steps

    def evaluate(self) -> dict:
        """``eval_loss``, the mean loss over the held-out batches with the current weights
        (the forward part of the graph only, Dropout off and BatchNorm on its running
        statistics, as model.eval(): nothing is differentiated or updated); for a mean
        cross-entropy also ``eval_perplexity`` and ``eval_accuracy``."""
        total, correct, counted = 0.0, 0, 0
        head = self.classification
        fetches = list(self.graph.losses) + ([head.scores] if head else [])
        for feeds in self.eval_batches:
            feeds = dict(feeds)
            for name, value in (*self.params.items(), *self.buffers.items()):
                feeds[name] = value.astype(self.compute_dtype, copy=False)
            with np.errstate(over="ignore", invalid="ignore", divide="ignore"), \
                    self.session.inference_mode():
                out = self.session.run(feeds, fetches)
            total += float(sum(np.sum(out[n], dtype=np.float64) for n in self.graph.losses))
            if head:
                right, count = correct_and_counted(to_host(out[head.scores]),
                                                   feeds[head.labels], head.ignore_index)
                correct, counted = correct + right, counted + count
        loss = total / len(self.eval_batches)
        if not head:
            return {"eval_loss": loss}
        return {"eval_loss": loss, "eval_perplexity": perplexity(loss),
                "eval_accuracy": correct / counted if counted else math.nan}

    # -- non-finite steps -------------------------------------------------------------------
    def _fault_message(self, step: int, kind: str, loss: float, grads: dict, feeds: dict
                       ) -> str:
        if kind == "loss":
            what = f"step {step}: loss is {loss}"
            wanted = _nonfinite(np.array([loss]))
        else:
            bad = [(name, k) for name, grad in grads.items() if (k := _nonfinite(grad))]
            name, k = bad[0] if bad else ("?", "non-finite")
            more = f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""
            what = f"step {step}: gradient of {name!r}{more} holds {k} (loss {loss:.6g})"
            wanted = k if bad else None
        # the same Dropout masks as the step itself
        _reseed(self.session, self.settings.seed * 1_000_003 + step - 1)
        found = locate_nonfinite(self.session, feeds, set(self.params), wanted)
        if found is None:
            comm = getattr(self, "comm", None)   # a distributed trainer's communicator
            found = ("this rank's share of the batch gave finite values when run again "
                     "(the rank whose share produced it names the node)"
                     if comm is not None and comm.size > 1 else
                     "every tensor was finite when the step was run again")
        return f"{what}; {found}"

    def _where_saved(self) -> str:
        directory = self.settings.checkpoint_dir
        if self._last_checkpoint and self._checkpoint_step is not None:
            return (f"the last good checkpoint {self._last_checkpoint} (step "
                    f"{self._checkpoint_step}) was left as it was")
        if directory:
            return f"no checkpoint had been saved in {directory} yet"
        return "nothing was saved (--checkpoint DIR would keep the last good state)"

    # -- hooks a distributed trainer overrides (see .distributed) ---------------------------
    def _run_graph(self, feeds: dict) -> dict:
        self._next_weight_generation(feeds)
        # memory a gradient output may view but the step must not scale in place
        self._not_ours = {id(memory_owner(v)) for v in feeds.values()} | self._constants
        return self.session.run(feeds, self.fetches, to_host=not self._on_device)

    def _accumulator(self, grads: dict) -> dict:
        """Gradients the next micro-batches' are added to: the first's own arrays (a
        distributed trainer's are views of its all-reduce buckets, which it copies)."""
        return grads

    def _update_buffers(self, out: dict) -> None:
        """The running statistics the step computed become the next step's (float32 arrays
        of their own: the step's outputs are recycled)."""
        for buffer, updated in self.graph.buffer_updates.items():
            self.buffers[buffer] = out[updated].astype(np.float32, copy=True)

    def _next_weight_generation(self, feeds: dict) -> None:
        """A new generation each step: the optimizer updated the weights in place since."""
        self.weight_generation.bump([feeds[name] for name in self.params if name in feeds])

    def _gradients(self, out: dict, scale: float, loss: float
                   ) -> tuple[float, dict[str, np.ndarray], bool]:
        """(loss, float32 unscaled gradients, all finite) of one step's graph outputs."""
        grads = {}
        finite = True
        checks = []
        taken = set(self._not_ours)
        for param in self.graph.params:
            grad = own_gradient(out[self.graph.grads[param]], taken)
            if scale != 1.0:
                grad /= np.float32(scale)
            if self._on_device:
                checks.append(self.session.backend.xp.isfinite(grad).all())
            else:
                finite = finite and bool(np.isfinite(grad).all())
            grads[param] = grad
        if checks:  # one device->host read for all of them
            xp = self.session.backend.xp
            finite = bool(xp.all(xp.stack(checks)))
        return loss, grads, finite

    def _stop_requested(self, stop: StopFlag) -> bool:
        return stop.requested

    # -- the loop -------------------------------------------------------------------------
    def run(self) -> TrainResult:
        settings = self.settings
        interrupted = False
        items = self.batches.samples_per_step
        pinned = blas_threads.threads_set(self.blas_threads) if self.blas_threads \
            else contextlib.nullcontext()
        try:
            with pinned, StopFlag() as stop:
                self.stop_flag = stop
                while self.step < settings.total_steps:
                    record = self.train_step()
                    if self._eval_due():
                        evaluation = self.evaluate()
                        record.update(evaluation)
                        self.history.note_evaluation(evaluation)
                        if self.progress is not None:
                            self.progress.note(f"step {self.step}: {eval_words(record)}")
                    if self.log is not None:
                        self.log.write(record)
                    if self.progress is not None:
                        self.progress.update(self.step, record["loss"], items,
                                             record["skipped"], record["loss_scale"])
                    if self.after_step is not None:
                        self.after_step(self.step, record)
                    if settings.checkpoint_dir and self._checkpoint_due():
                        self.save_checkpoint(settings.checkpoint_dir)
                    if self._stop_requested(stop) and self.step < settings.total_steps:
                        interrupted = True
                        break
        finally:
            if self.progress is not None:
                self.progress.close()
        if settings.checkpoint_dir:
            self.save_checkpoint(settings.checkpoint_dir)
        elif interrupted and settings.interrupt_dir:
            self._save_interrupted(settings.interrupt_dir)
        return TrainResult({n: to_host(v).astype(np.float32, copy=False)
                            for n, v in self.params.items()},
                           self.history, self.step, self.scaler.skipped, interrupted,
                           self._last_checkpoint, dict(self.nonfinite),
                           stop.signum if interrupted else None,
                           {n: to_host(v).astype(np.float32, copy=False)
                            for n, v in self.buffers.items()})

    def _save_interrupted(self, base: str) -> None:
        """Ctrl-C without --checkpoint: save in this run's own folder under ``base``, never
        over the checkpoint another run left there (see :func:`checkpoint.claim_run_folder`)."""
        comm = getattr(self, "comm", None)   # a distributed trainer's: rank 0 writes
        if comm is not None and comm.rank != 0:
            return
        identity = ckpt.run_identity(self.graph.fingerprint or None, self.settings.run_settings,
                                     {"seed": self.batches.seed, "size": self.batches.size,
                                      "batch_size": self.batches.batch_size})
        name = self.settings.run_settings.get("model") or ckpt.run_name(None)
        lock = ckpt.claim_run_folder(base, name, identity)
        try:
            self.save_checkpoint(lock.directory)
        finally:
            lock.release()

    def saved(self) -> tuple[str, int] | None:
        """(path, step) of the last complete checkpoint there is for this run: written by
        it, or the one it resumed from; None if there is none."""
        if self._last_checkpoint is None or self._checkpoint_step is None:
            return None
        return self._last_checkpoint, self._checkpoint_step

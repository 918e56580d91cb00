"""``graphopt run``: everything between the parsed options and the files written.

The CLI builds a :class:`RunOptions` and calls :func:`run`; tests and scripts call it too.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import signal
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import onnx

from graphopt import modelio
from graphopt.errors import GraphoptError
from graphopt.executor import ExecutorError, Session, describe_compiled_kernels, memory
from graphopt.executor.session import value_type
from graphopt.training.dropped_biases import restore_dropped_biases
from graphopt.training.graph import has_yield
from graphopt.training.prepare import trained_params, untied_params
from graphopt.training.selection import listed_names
from graphopt.training.shared import find_merges, split
from graphopt.training.ties import tie_entries
from graphopt.training.weights import with_weights

from . import checkpoint as ckpt
from . import distributed
from .data import Batches, array_shapes, load_npz
from .export import plot_format, plot_losses, require_matplotlib, save_model
from .loop import LoopSettings, NonFiniteError, Trainer, TrainResult
from .loss_scaling import parse_loss_scale
from .optimizers import make_optimizer
from .options import RunOptions, checked
from .precision import default_precision
from .progress import Progress, StepLog
from .schedule import check_schedule
from .training_graph import RunGraph, build, describe_params, tensor_value, with_tied_copies

# Without --checkpoint, a Ctrl-C saves in ./INTERRUPT_DIR/<model>-<run id>/: a folder per run
# (see checkpoint.claim_run_folder), so one run's Ctrl-C never replaces another run's checkpoint.
INTERRUPT_DIR = "graphopt-checkpoint"


@dataclass
class RunOutcome:
    graph: RunGraph
    result: TrainResult
    session: Session
    forward: onnx.ModelProto
    written: list[str] = field(default_factory=list)
    plot_title: str = ""
    external: modelio.ExternalFiles | None = None  # where forward's weights' bytes are


DEFAULTS = {"batch_size": 32, "optimizer": "adamw", "lr": 1e-3}


def _resolve_source(opts: RunOptions):
    """(forward model, data arrays or None, example defaults, the loaded source Model)."""
    if (opts.model is None) == (opts.example is None):
        raise GraphoptError("give a MODEL or --example NAME (not both)")
    if opts.example is not None:
        from graphopt.examples import load_example

        example = load_example(opts.example)
        data = load_npz(opts.data) if opts.data else example.data
        return example.model, data, example.settings, None
    if not os.path.exists(opts.model):
        raise GraphoptError(f"{opts.model}: no such file")
    if opts.data is None:
        raise GraphoptError("--data FILE.npz is required to train a model file")
    model = modelio.load(opts.model)  # the same checks as optimize: one-line errors, no escapes
    # training needs the weights themselves, read from the files the load checked (external
    # data, or the model file whose inline weights it references) once they are known to fit
    # in memory: each where it is used (its starting value, the session's constants), never
    # into the graph protos the preparation copies and rewrites
    _refuse_weights_beyond_memory(model)
    return model.proto, load_npz(opts.data), {}, model


def _refuse_weights_beyond_memory(model) -> None:
    """External weights larger than the memory available are refused before any is read
    (they are read into host memory whatever the device)."""
    if not model.has_external_data():
        return
    needed = modelio.external_bytes(model)
    available = memory.available_bytes(None)
    if available is not None and needed > available:
        raise GraphoptError(f"{model.path}: its external weights are {memory.human(needed)}, "
                            f"more than the {memory.human(available)} of memory available "
                            f"({memory.limit_source()}); nothing was read")


def one_line(exc: BaseException) -> str:
    """An error message on one line: the executor lists unsupported ops one per line."""
    lines = [line.strip().lstrip("- ").strip() for line in str(exc).splitlines()]
    lines = [line for line in lines if line] or [type(exc).__name__]
    return " ".join([lines[0], "; ".join(lines[1:])]).strip()


MAX_SEED = 2**32 - 1   # numpy's and CuPy's seed range (the step is mixed into it)


def _check_seed(seed) -> None:
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise GraphoptError(f"--seed must be an integer from 0 to {MAX_SEED}, not {seed!r}")


def _protected_inputs(opts: RunOptions, source) -> modelio.ProtectedFiles:
    """Every file the run reads: the model and its external data, --data, --eval-data and
    the checkpoint it resumes. No output may replace one of them."""
    protect = modelio.ProtectedFiles()
    if source is not None:
        protect.add_model(source)
    protect.add(opts.data, "--data file")
    protect.add(opts.eval_data, "--eval-data file")
    if opts.resume and opts.checkpoint:
        protect.add(ckpt.path_in(opts.checkpoint), "checkpoint being resumed")
    return protect


def _check_outputs(opts: RunOptions, source) -> modelio.ProtectedFiles:
    """Refuse bad output paths before any training happens: none may be a file the run
    reads (the model, its external data, --data, --eval-data, the resumed checkpoint; -o may
    be the model itself with --in-place), none may be a FIFO or a device, and no two may be
    the same file. Returns the files every writer checks again just before it publishes."""
    protect = _protected_inputs(opts, source)
    denormal = opts.denormal_report if opts.denormal_report != "-" else None
    outputs = {"-o": opts.output, "--save-graph": opts.save_graph, "--plot": opts.plot,
               "--denormal-report": denormal, "--log": opts.log}
    for option, path in outputs.items():
        if path:
            modelio.check_output_path(path, source, opts.overwrite_input and option == "-o",
                                      what="output" if option == "-o" else option,
                                      protect=protect)
    checkpoint = None   # without --checkpoint, a Ctrl-C saves in a new folder of its own
    if opts.checkpoint:
        checkpoint = ckpt.path_in(opts.checkpoint)
        modelio.refuse_input_files(checkpoint, source, what="checkpoint")
        resumed = (checkpoint,) if opts.resume else ()
        protect.refuse(checkpoint, "checkpoint", allow=resumed)   # it replaces its own
    modelio.refuse_same_outputs({**outputs, "--checkpoint": checkpoint})
    if opts.plot:
        plot_format(opts.plot)
        require_matplotlib()
    if opts.resume and not opts.checkpoint:
        raise GraphoptError("--resume needs --checkpoint DIR")
    if opts.allow_changed_graph and not opts.resume:
        raise GraphoptError("--allow-changed-graph applies only with --resume")
    return protect


def _refuse_bad_counts(opts: RunOptions) -> None:
    """Counts wrong whatever the model (the same checks as :func:`_total_steps` and the
    clip check make later): refused before a large model costs its preparation."""
    if opts.steps is not None and opts.epochs is not None:
        raise GraphoptError("give --steps or --epochs, not both")
    if opts.steps is not None and opts.steps < 1:
        raise GraphoptError(f"--steps must be >= 1, not {opts.steps}")
    if opts.epochs is not None and opts.epochs < 1:
        raise GraphoptError(f"--epochs must be >= 1, not {opts.epochs}")
    if opts.clip_grad_norm is not None and not 0 < opts.clip_grad_norm < math.inf:
        raise GraphoptError(f"--clip-grad-norm must be a finite number > 0, not "
                            f"{opts.clip_grad_norm}")


def _total_steps(opts: RunOptions, defaults: dict, batches: Batches) -> int:
    steps = opts.steps if opts.steps is not None else None
    epochs = opts.epochs
    if steps is not None and epochs is not None:
        raise GraphoptError("give --steps or --epochs, not both")
    if steps is None and epochs is None:
        steps, epochs = defaults.get("steps"), defaults.get("epochs", 1)
    if steps is not None:
        if steps < 1:
            raise GraphoptError(f"--steps must be >= 1, not {steps}")
        return steps
    if epochs < 1:
        raise GraphoptError(f"--epochs must be >= 1, not {epochs}")
    return epochs * batches.steps_per_epoch


def _pick(opts: RunOptions, defaults: dict, name: str):
    value = getattr(opts, name)
    if value is not None:
        return value
    return defaults.get(name, DEFAULTS.get(name))


# (size, rank) variables MPI launchers set in every process they start: Open MPI, MPICH
# and Intel MPI (Hydra, PMI), MVAPICH2, Slurm's srun (job steps only).
LAUNCHER_VARIABLES = (("OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK"),
                      ("PMI_SIZE", "PMI_RANK"), ("MV2_COMM_WORLD_SIZE", "MV2_COMM_WORLD_RANK"),
                      ("SLURM_STEP_NUM_TASKS", "SLURM_PROCID"))


def launched_ranks(environ=None) -> tuple[int, int, str] | None:
    """(ranks, this rank, the variable that says so) when an MPI launcher started several
    copies of this process; None for a single process."""
    environ = os.environ if environ is None else environ
    for size_name, rank_name in LAUNCHER_VARIABLES:
        size, rank = environ.get(size_name, ""), environ.get(rank_name, "0")
        if size.isdigit() and int(size) > 1:
            return int(size), int(rank) if rank.isdigit() else 0, f"{size_name}={size}"
    return None


def _refuse_copies_without_distributed(opts: RunOptions) -> None:
    """``mpiexec -n 4 graphopt run`` without --distributed would train four unrelated copies
    with interleaved output and four writers of the same files: refuse. Rank 0 says why;
    the other ranks exit 1 quietly, so the user reads one line."""
    if opts.distributed or opts.list_params:
        return
    found = launched_ranks()
    if found is None:
        return
    size, rank, variable = found
    if rank != 0:
        raise SystemExit(1)
    raise GraphoptError(f"started as {size} processes by an MPI launcher ({variable}) without "
                        f"--distributed: each would train its own copy; add --distributed to "
                        f"train data-parallel, or run one process")


def run(opts: RunOptions, echo: Callable[[str], None] = print, *, progress_stream=None,
        after_step=None, gradient_reducer: type | None = None) -> RunOutcome:
    """``gradient_reducer``: a ``distributed.GradientReducer`` subclass for a distributed
    run (None: the standard one)."""
    opts = checked(opts)   # a RunOptions made in Python holds what the command line would
    _refuse_copies_without_distributed(opts)
    dist = distributed.start(opts.distributed, opts.bucket_mb, opts.dist_timeout,
                             opts.dist_check_every, opts.dist_overlap)
    if dist is not None and gradient_reducer is not None:
        dist = dataclasses.replace(dist, reducer_class=gradient_reducer)
    if dist is None:
        return _run(opts, echo, progress_stream, after_step, None)
    if not dist.writer:
        echo = _silent   # rank 0 speaks for the job; the others only report their errors
    try:
        return _run(opts, echo, progress_stream, after_step, dist)
    except SystemExit:
        raise
    except NonFiniteError as exc:
        # decided alike on every rank at the same step (the loss and the overflow flag are
        # all-reduced first): every rank stops on its own, no rank is left waiting
        if dist.size == 1 or dist.writer:
            raise
        raise NonFiniteError(f"[rank {dist.rank}/{dist.size}] {exc.finding}",
                             exc.finding) from None
    except BaseException as exc:
        if dist.size == 1:
            raise
        dist.comm.fail(exc)   # abort the job: the other ranks would only wait for this one
        raise


def _silent(_text: str) -> None:
    pass


def _run(opts: RunOptions, echo, progress_stream, after_step,
         dist: distributed.Distributed | None) -> RunOutcome:
    """The run, holding the checkpoint folder's lock (one run per folder, see checkpoint)
    from the moment its outputs are checked: a refused run leaves the folder untouched."""
    held: list[ckpt.FolderLock] = []
    try:
        return _run_locked(opts, echo, progress_stream, after_step, dist, held)
    finally:
        for lock in held:
            lock.release()


def _run_locked(opts: RunOptions, echo, progress_stream, after_step,
                dist: distributed.Distributed | None, held: list) -> RunOutcome:
    writer = dist is None or dist.writer
    say = (lambda _text: None) if opts.quiet else echo
    _refuse_bad_counts(opts)   # before the model is read and its training graph prepared
    forward, arrays, defaults, source = _resolve_source(opts)
    external = source.external if source is not None else None
    protect = _check_outputs(opts, source)
    if opts.checkpoint and writer:
        held.append(ckpt.FolderLock.acquire(opts.checkpoint))
    if opts.resume:
        opts = _settings_from_checkpoint(opts, dist)
    if opts.seed is None:
        opts = dataclasses.replace(opts, seed=0)
    _check_seed(opts.seed)
    forward = _as_pytorch_parameters(opts, forward, external, say)
    precision, note = default_precision(forward, opts.precision)
    if note:
        say(f"note: {note}")
    _warn_if_nothing_saved(opts, writer, say)
    scaler = parse_loss_scale(opts.loss_scale, precision)
    optimizer = make_optimizer(_pick(opts, defaults, "optimizer"), _pick(opts, defaults, "lr"),
                               opts.weight_decay, bool(opts.weight_decay_all))
    loss = opts.loss if opts.loss is not None else defaults.get("loss")
    labels = opts.labels if opts.labels is not None else defaults.get("labels")

    graph = build(forward, loss=loss, labels=labels, freeze=opts.freeze, train=opts.train,
                  level=opts.level, precision=precision, disable=opts.disable,
                  label_shapes=array_shapes(arrays),
                  ignore_index=-100 if opts.ignore_index is None else opts.ignore_index,
                  padding_idx=opts.padding_idx,
                  class_axis=opts.class_axis, external=external, untie=bool(opts.untie),
                  recompute=opts.recompute or "none")
    for title, report in graph.reports:
        say(f"== {title}")
        say(report.format_table())
    if graph.recomputation is not None:
        say(graph.recomputation.describe())
    if opts.save_graph and writer:
        for path in save_model(graph.proto, opts.save_graph, protect=protect,
                               what="--save-graph", external=external):
            protect.add(path, "training graph written by --save-graph")
        say(f"wrote the training graph to {opts.save_graph}")

    if dist is not None:
        distributed.bind_device(opts.device, dist.comm)
    try:
        session = Session(graph.proto, device=opts.device, numerics=opts.numerics,
                          training=True, seed=opts.seed,
                          denormal_stats=opts.denormal_report is not None,
                          external_values=external.array if external is not None else None,
                          fed=[*graph.params, *graph.buffer_updates])   # the trainer's: fed
    except ExecutorError as exc:
        raise GraphoptError(one_line(exc)) from None
    if session.numerics is not None and hasattr(session.numerics, "describe"):
        say(session.numerics.describe())

    input_types = {name: value_type(vi) for vi in graph.proto.graph.input
                   if (name := vi.name) in graph.data_inputs}
    accumulate = batch_accumulation(opts)
    if dist is None:
        batches = Batches(arrays, graph.data_inputs, _pick(opts, defaults, "batch_size"),
                          opts.seed, input_types, accumulate)
    else:
        batches = distributed.ShardedBatches(arrays, graph.data_inputs,
                                             _pick(opts, defaults, "batch_size"), opts.seed,
                                             input_types, dist.rank, dist.size, accumulate)
    if batches.ignored:
        say(f"note: data arrays not read by the graph: {batches.ignored}")
    total = _total_steps(opts, defaults, batches)
    settings = LoopSettings(total, precision, opts.seed, opts.checkpoint, opts.checkpoint_every,
                            INTERRUPT_DIR)
    schedule = opts.lr_schedule or "constant"
    check_schedule(schedule, opts.warmup or 0, total)
    if opts.clip_grad_norm is not None and not 0 < opts.clip_grad_norm < math.inf:
        raise GraphoptError(f"--clip-grad-norm must be a finite number > 0, not "
                            f"{opts.clip_grad_norm}")
    settings.allow_changed_graph = opts.allow_changed_graph
    settings.history_rows = opts.history_rows
    settings.lr_schedule, settings.warmup = schedule, opts.warmup or 0
    settings.clip_grad_norm, settings.eval_every = opts.clip_grad_norm, opts.eval_every
    settings.run_settings = _settings_record(opts, loss, labels, optimizer, precision,
                                             batches.batch_size, total)
    eval_batches = _eval_batches(opts, graph, batches.batch_size, input_types)
    log = StepLog(opts.log, append=opts.resume) if opts.log and writer else None
    progress = None if opts.quiet or not writer else Progress(
        total, unit="samples", stream=progress_stream, echo=echo)
    warn = progress.note if progress is not None else None   # not with -q, rank 0 only
    common = dict(progress=progress, log=log, echo=echo, after_step=after_step, warn=warn)
    if dist is None:
        trainer = Trainer(graph, session, batches, optimizer, scaler, settings, **common)
        trainer.eval_batches = eval_batches
    else:
        trainer = distributed.DistributedTrainer(graph, session, batches, optimizer, scaler,
                                                 settings, comm=dist.comm, dist=dist.settings,
                                                 reducer_class=dist.reducer_class, **common)
        trainer.eval_batches = eval_batches   # every rank evaluates the whole held-out set
        trainer.check_same_settings(distributed.fingerprint(trainer, scaler.state()))
        say(trainer.describe())
    if opts.resume:
        trainer.resume_from(opts.checkpoint)
        if progress is not None:
            progress.start = trainer.step
        say(f"resumed from {ckpt.path_in(opts.checkpoint)} at step {trainer.step}")
        if trainer.step >= total:
            raise GraphoptError(
                f"--resume: the checkpoint in {opts.checkpoint} is at step {trainer.step} and "
                f"this run is {total} steps long: nothing left to train; pass --steps N with "
                f"N > {trainer.step} (or more --epochs) to train on")
    if not has_yield(forward):
        for line in describe_params(forward, graph.params, opts.freeze, opts.train,
                                    graph.tied, opts.padding_idx):
            say(line)
    say(f"training {len(graph.params)} tensors "
        f"({sum(v.size for v in graph.initial.values()):,} weights) for {total} steps of "
        f"{_batch_words(batches)} ({batches.steps_per_epoch} steps per epoch); optimizer "
        f"{optimizer.name} lr {optimizer.lr:g}{_schedule_words(settings)}"
        f"{_decay_words(optimizer, graph.initial)}; precision "
        f"{precision}; loss scale "
        f"{scaler.describe()}; device {session.device}{_kernel_words(session)}")
    if session.device == "cpu" and precision != "fp32":
        # NumPy has no float16 arithmetic units to use: each op converts to float32 and back
        say(f"note: --precision {precision} on the CPU emulates FP16 (float16 storage, float32 "
            "arithmetic, a conversion each way per op): a step takes several times an fp32 one "
            "(about 8x on --example mqa); a GPU computes FP16 natively")
    say(trainer.memory_plan()[1])
    try:
        try:
            result = trainer.run()
        except ExecutorError as exc:
            raise GraphoptError(f"training step {trainer.step + 1} failed: {one_line(exc)}") \
                from None
        finally:
            if log is not None:
                log.close()
        # what only training needed goes before the outputs are written: the optimizer's
        # state and the memory the session kept for a next step
        optimizer.release()
        session.release_memory()
        outcome = RunOutcome(graph, result, session, forward, external=external)
        numerics = getattr(session.numerics, "mode", "native")
        outcome.plot_title = (f"graphopt run {opts.example or os.path.basename(opts.model or '')}\n"
                              f"precision {precision}, numerics {numerics}, loss scale "
                              f"{scaler.describe().split(' (')[0]}, {optimizer.name} lr "
                              f"{optimizer.lr:g}")
        if writer:
            _finish(opts, outcome, say, echo, protect)
    except KeyboardInterrupt as exc:
        # a second Ctrl-C (or SIGTERM) ends the run at once: the CLI says what is kept
        exc.kept = _kept(opts, trainer) if writer else None
        raise
    return outcome


def _kept(opts: RunOptions, trainer: Trainer) -> str | None:
    """What an aborted run leaves that the user can use, in words (None: nothing)."""
    parts = []
    if opts.save_graph and os.path.exists(opts.save_graph):
        parts.append(f"the training graph is in {opts.save_graph}")
    saved = trainer.saved()
    if saved is not None:
        path, step = saved
        parts.append(f"the checkpoint of step {step} is {path} (continue with --checkpoint "
                     f"{os.path.dirname(path) or '.'} --resume)")
    return "; ".join(parts) or None


# Options a checkpoint keeps: a bare ``--resume`` continues the same run; one given again with
# another value is an error (the length, --steps/--epochs, may change: that trains on).
RESUMED = ("loss", "labels", "optimizer", "lr", "weight_decay", "weight_decay_all", "precision",
           "loss_scale", "batch_size", "grad_accum", "seed", "freeze", "train", "ignore_index",
           "padding_idx", "lr_schedule", "warmup", "clip_grad_norm", "class_axis", "untie",
           "split_shared")


def batch_accumulation(opts: RunOptions) -> int:
    """The micro-batches per step (--grad-accum; 1 without)."""
    return 1 if opts.grad_accum is None else opts.grad_accum


def _batch_words(batches) -> str:
    if batches.accumulate == 1:
        return str(batches.batch_size)
    return (f"{batches.samples_per_step} ({batches.accumulate} accumulated micro-batches of "
            f"{batches.batch_size})")


def _decay_words(optimizer, weights: dict) -> str:
    """How the weight decay applies: to which tensors, or none."""
    if not optimizer.weight_decay:
        return ""
    groups = optimizer.decay_groups(weights)
    if len(groups) == 1 and (optimizer.decay_all or groups[0][0]):
        return f", weight decay {optimizer.weight_decay:g} on every tensor"
    decayed = next((len(group) for decay, group in groups if decay), 0)
    return (f", weight decay {optimizer.weight_decay:g} on the {decayed} tensors of rank >= 2 "
            "(biases and norm weights exempt, as transformers' Trainer; --weight-decay-all "
            "decays them too)")


def _settings_record(opts: RunOptions, loss, labels, optimizer, precision: str,
                     batch_size: int, total: int) -> dict:
    record = {"loss": loss, "labels": labels, "optimizer": optimizer.name, "lr": optimizer.lr,
              "weight_decay": optimizer.weight_decay,
              "weight_decay_all": optimizer.decay_all, "precision": precision,
              "loss_scale": opts.loss_scale, "batch_size": batch_size,
              "grad_accum": batch_accumulation(opts), "seed": opts.seed,
              "freeze": list(opts.freeze), "train": list(opts.train), "steps": total,
              "ignore_index": -100 if opts.ignore_index is None else opts.ignore_index,
              "lr_schedule": opts.lr_schedule or "constant", "warmup": opts.warmup or 0,
              "clip_grad_norm": opts.clip_grad_norm,
              "model": ckpt.run_name(opts.model or opts.example)}   # names a Ctrl-C's folder
    for key in RESUMED:
        if key not in record and getattr(opts, key, None) is not None:
            record[key] = getattr(opts, key)
    return record


def _settings_from_checkpoint(opts: RunOptions, dist=None) -> RunOptions:
    """Fill the options left out from the checkpoint's; one error listing every option given
    with a value different from the checkpoint's. In a data-parallel job rank 0 reads them
    and sends them to the others (as it does the checkpoint itself)."""
    if dist is None or dist.size == 1:
        saved = ckpt.read_settings(opts.checkpoint)
    else:
        mine = ckpt.read_settings(opts.checkpoint) if dist.rank == 0 else None
        saved = dist.comm.bcast_object(mine, 0, "the checkpoint's settings")
    if not saved:
        return opts   # no checkpoint, or an older one: resume_from checks what it can
    values, differ = {}, []
    for key in RESUMED:
        if key not in saved or not hasattr(opts, key):
            continue
        given, stored = getattr(opts, key), saved[key]
        if isinstance(stored, list):
            stored = tuple(stored)
        if given is None or given == ():
            values[key] = stored
        elif (tuple(given) if isinstance(given, list) else given) != stored:
            flag = "--" + key.replace("_", "-")
            differ.append(f"{flag} {_shown(given)} (the checkpoint's run: {_shown(stored)})")
    if differ:
        raise GraphoptError(f"--resume continues the run saved in {opts.checkpoint}, but "
                            f"{'; '.join(differ)}; leave these options out to continue it")
    if opts.steps is None and opts.epochs is None and saved.get("steps"):
        values["steps"] = int(saved["steps"])
    return dataclasses.replace(opts, **values)


def _shown(value) -> str:
    if isinstance(value, (tuple, list)):
        return " ".join(map(str, value)) or "(none)"
    return "(default)" if value is None else f"{value:g}" if isinstance(value, float) \
        else str(value)


def _schedule_words(settings: LoopSettings) -> str:
    words = ""
    if settings.lr_schedule != "constant" or settings.warmup:
        words += f" ({settings.lr_schedule} schedule, warmup {settings.warmup} steps)"
    if settings.clip_grad_norm is not None:
        words += f", gradient norm clipped to {settings.clip_grad_norm:g}"
    return words


def _eval_batches(opts: RunOptions, graph: RunGraph, batch_size: int, input_types: dict
                  ) -> list[dict]:
    """--eval-data in order, in batches of --batch-size (fewer rows if the held-out set is
    smaller; a last partial batch is left out, as in training)."""
    if opts.eval_data is None:
        if opts.eval_every is not None:
            raise GraphoptError("--eval-every needs --eval-data FILE.npz")
        return []
    if opts.eval_every is not None and opts.eval_every < 1:
        raise GraphoptError(f"--eval-every must be >= 1, not {opts.eval_every}")
    arrays = load_npz(opts.eval_data, "--eval-data")
    lengths = [shape[0] for shape in array_shapes(arrays).values() if shape]
    size = min(lengths) if lengths else 0
    try:
        held_out = Batches(arrays, graph.data_inputs, min(batch_size, max(size, 1)), opts.seed,
                           input_types)
    except GraphoptError as exc:
        raise GraphoptError(f"--eval-data {opts.eval_data}: {exc}") from None
    step = held_out.batch_size
    return [{name: array[i * step:(i + 1) * step] for name, array in held_out.arrays.items()}
            for i in range(held_out.steps_per_epoch)]


def _warn_if_nothing_saved(opts: RunOptions, writer: bool, echo) -> None:
    """Trained weights that nobody asked to keep are lost at the end: say so up front, and
    where a Ctrl-C would save them."""
    if opts.output or opts.checkpoint or not writer:
        return
    folder = f"./{INTERRUPT_DIR}/{ckpt.run_name(opts.model or opts.example)}-<run id>/"
    echo(f"warning: the trained weights will not be saved (no -o FILE.onnx, no --checkpoint "
         f"DIR); only a Ctrl-C saves a checkpoint, in {folder} (a folder of this run's own; "
         "the interrupt message names it)")


def _as_pytorch_parameters(opts: RunOptions, forward: onnx.ModelProto, external, say
                           ) -> onnx.ModelProto:
    """The forward model with the parameters PyTorch has: merged ones split, dropped zero
    biases back (a run and --list-params alike)."""
    forward = _merged_parameters(opts, forward, external, say)
    _restore_dropped_biases(forward, say)
    return forward


def _restore_dropped_biases(forward: onnx.ModelProto, say) -> None:
    """The zero biases the dynamo exporter dropped, back in ``forward`` (the run's own copy)
    as the parameters PyTorch trains (:mod:`graphopt.training.dropped_biases`)."""
    if has_yield(forward):
        return
    restored = restore_dropped_biases(forward)
    if restored:
        say(f"restored {len(restored)} zero bias(es) the exporter dropped, as the parameters "
            f"PyTorch trains: {listed_names(restored, 3)}")


def _merged_parameters(opts: RunOptions, forward: onnx.ModelProto, external, say
                       ) -> onnx.ModelProto:
    """The forward model with each exporter-merged parameter (:mod:`graphopt.training.shared`)
    split into one per module, as PyTorch has them (the default); with --no-split-shared the
    same model and a note saying what was merged. A model that is a training graph already
    is left alone."""
    if has_yield(forward):
        return forward
    candidates = trained_params(forward, (), opts.train)
    merges = find_merges(forward, candidates, lambda tensor: tensor_value(tensor, external))
    if not merges:
        return forward
    shown = "; ".join(m.describe() for m in merges[:2])
    more = f" (and {len(merges) - 2} more)" if len(merges) > 2 else ""
    count = sum(len(m.copies) + 1 for m in merges)
    if opts.split_shared is False:
        say(f"note: {len(merges)} trained tensor(s) stand for the parameters of several "
            f"modules: {shown}{more}. An exporter merges parameters that start equal (a "
            f"fresh model's ones and zeros); PyTorch trains {count} tensors there, graphopt "
            f"{len(merges)} (--no-split-shared)")
        return forward
    split_model = onnx.ModelProto()
    split_model.CopyFrom(forward)
    split(split_model, merges)
    say(f"split {len(merges)} merged tensor(s) into {count}, one per module as PyTorch has "
        f"them: {shown}{more} (the exporter merged them because they start equal; "
        "--no-split-shared trains each as one tensor)")
    return split_model


def list_params(opts: RunOptions, echo: Callable[[str], None] = print) -> list[str]:
    """``graphopt run --list-params``: what a run with these options would train, and what
    it would leave out and why; no data needed, nothing trained or written."""
    if (opts.model is None) == (opts.example is None):
        raise GraphoptError("give a MODEL or --example NAME (not both)")
    if opts.example is not None:
        from graphopt.examples import load_example

        forward, external = load_example(opts.example).model, None
    else:
        if not os.path.exists(opts.model):
            raise GraphoptError(f"{opts.model}: no such file")
        loaded = modelio.load(opts.model)
        forward, external = loaded.proto, loaded.external
    if has_yield(forward):
        raise GraphoptError("the model is already a training graph (it has a YieldOp): it "
                            "trains what its graphopt metadata lists, or else the "
                            "initializers that have a '<name>_grad' output")
    forward = _as_pytorch_parameters(opts, forward, external, echo)
    params, ties = untied_params(forward, trained_params(forward, opts.freeze, opts.train),
                                 bool(opts.untie), external)
    lines = describe_params(forward, params, opts.freeze, opts.train, tie_entries(ties),
                            opts.padding_idx)
    for line in lines:
        echo(line)
    return params


def _finish(opts: RunOptions, outcome: RunOutcome, say, echo,
            protect: modelio.ProtectedFiles | None = None) -> None:
    result = outcome.result
    if result.history:
        history = result.history
        tail = [value for value in history.losses if np.isfinite(value)][-10:] or [np.nan]
        counts = ", ".join(f"non-finite {kind} {count}"
                           for kind, count in sorted(result.nonfinite.items()))
        each = f" records of {history.stride} steps" if history.stride > 1 else ""
        say(f"loss: first step {history.first_loss:.4f}, last step {history.last_loss:.4f} "
            f"(mean of the last {len(tail)}{each}: {np.mean(tail):.4f}); skipped steps "
            f"{result.skipped}" + (f" ({counts})" if counts else ""))
    evaluated = [r for r in result.history if r.get("eval_loss") is not None]
    if evaluated:
        best = min(evaluated, key=lambda r: r["eval_loss"])
        last = evaluated[-1]
        accuracy = (f"; accuracy last {100 * last['eval_accuracy']:.1f}%, perplexity last "
                    f"{last['eval_perplexity']:.4g}" if "eval_accuracy" in last else "")
        say(f"eval loss: last {last['eval_loss']:.4f} (step {last['step']}), "
            f"best {best['eval_loss']:.4f} (step {best['step']}){accuracy}")
    if result.interrupted:
        where = result.checkpoint or "(nothing saved)"
        how = "terminated (SIGTERM)" if result.stop_signal == signal.SIGTERM else "interrupted"
        echo(f"{how} after step {result.steps_done}; checkpoint {where}; continue with "
             f"--checkpoint {os.path.dirname(where) or '.'} --resume")
        return
    if result.checkpoint:
        say(f"checkpoint: {result.checkpoint}")
    protect = protect if protect is not None else modelio.ProtectedFiles()
    if opts.output:
        # the trained weights first: a failure or SIGTERM in an optional output after them
        # (the plot, the reports) loses nothing that cost training. The forward model as
        # given (no YieldOp, no gradients), with the trained weights
        trained = {**with_tied_copies(result.params, outcome.graph.tied), **result.buffers}
        written = save_model(with_weights(outcome.forward, trained),
                             opts.output,
                             protect=protect, external=outcome.external)
        for path in written:
            protect.add(path, "trained model written by -o")
        outcome.written.append(opts.output)
        say(f"wrote the trained model to {opts.output}")
    if opts.log:
        say(f"wrote the step log to {opts.log}")
    if opts.denormal_report is not None:
        _denormal_report(opts.denormal_report, outcome.session, say, protect)
    if opts.plot:
        plot_losses(result.history, opts.plot, outcome.plot_title, protect=protect)
        outcome.written.append(opts.plot)
        say(f"wrote {opts.plot}")


def _denormal_report(target: str, session: Session, say,
                     protect: modelio.ProtectedFiles | None = None) -> None:
    numerics = session.numerics
    report = numerics.denormal_report()
    say(numerics.format_denormal_table())
    if target != "-":
        modelio.write_text_atomic(target, json.dumps(report, indent=2), "--denormal-report",
                                  protect=protect)
        say(f"wrote {target}")


def _kernel_words(session) -> str:
    """What the CPU's float32 row and activation kernels run on (see docs/executor.md)."""
    if session.device != "cpu":
        return ""
    return f" (float32 row kernels: {describe_compiled_kernels()})"

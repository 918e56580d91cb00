"""What a ``graphopt run`` does, as one object: :class:`RunOptions`, whose fields carry the
command line that sets them.

Each field is one option of ``graphopt run``: its name, default and comment here, its flag,
type and help text in the field's :class:`Flag` (plain data: ``cli.py`` turns them into the
command's options, in this order, so the command and the Python API cannot drift apart). The
choices come from the tables that define them (optimizers, precisions, schedules).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace

from graphopt.errors import GraphoptError
from graphopt.training.recompute import RECOMPUTE_MODES

from .history import DEFAULT_CAPACITY, MAX_ROWS
from .optimizers import OPTIMIZERS
from .precision import PRECISIONS
from .schedule import SCHEDULES

DEVICES = ("auto", "cpu", "cuda", "rocm")
NUMERICS = ("auto", "native", "mi200")


@dataclass(frozen=True)
class Flag:
    """How the command line sets a field. ``names``: the flags (``("-o", "--output")``, a
    ``"--x/--no-x"`` switch) or, for the positional argument, the field's own name;
    ``kind``: text | int | float | path | dir | choice | flag | switch | many | argument |
    optional (a value that may be left out: ``flag_value`` then); ``low``/``high``: an int's
    range; ``show_default``: the help shows the field's default."""
    names: tuple[str, ...]
    help: str = ""
    kind: str = "text"
    metavar: str | None = None
    choices: tuple[str, ...] = ()
    low: int | None = None
    high: int | None = None
    show_default: bool = False
    flag_value: str | None = None


def option(default, *names: str, help: str = "", **flag):   # noqa: A002 (click's word)
    """A RunOptions field with its command-line flag."""
    return field(default=default, metadata={"cli": Flag(tuple(names), help, **flag)})


@dataclass
class RunOptions:
    model: str | None = option(None, "model", kind="argument")   # a path, or None: example
    example: str | None = option(
        None, "--example", metavar="NAME",
        help="Train a built-in example instead of MODEL: mqa, mlp-digits.")
    data: str | None = option(                                    # .npz; examples bring theirs
        None, "--data", kind="path", metavar="FILE.npz",
        help="Training arrays named after the graph inputs, batched along axis 0.")
    loss: str | None = option(
        None, "--loss", metavar="KIND|OUTPUT",
        help="cross_entropy, mse, output, or the name of a scalar graph output; "
             "cross_entropy:OUTPUT or mse:OUTPUT picks the prediction of a model with "
             "several outputs.")
    labels: str | None = option(None, "--labels", metavar="NAME",
                                help="Name of the labels input cross_entropy/mse add.")
    ignore_index: int | None = option(                            # None: -100
        None, "--ignore-index", kind="int", metavar="N",
        help="cross_entropy: labels equal to N do not count (default -100, as PyTorch; "
             "padding in language-model batches). The class axis of the logits is the one "
             "whose removal gives the labels' shape.")
    padding_idx: int | None = option(                             # None: a dynamo export's
        None, "--padding-idx", kind="int", metavar="N",
        help="Row N of the token embedding gets no gradient from its lookups, as "
             "nn.Embedding(padding_idx=N) (found in dynamo exports; TorchScript drops it).")
    class_axis: int | None = option(                              # None: found
        None, "--class-axis", kind="int", metavar="AXIS",
        help="cross_entropy: the logits' class axis, where two axes could be (e.g. a "
             "sequence as long as the vocabulary).")
    steps: int | None = option(None, "--steps", kind="int", help="Number of optimizer steps.")
    epochs: int | None = option(None, "--epochs", kind="int",
                                help="Number of passes over the data (instead of --steps).")
    batch_size: int | None = option(None, "--batch-size", kind="int",
                                    help="Samples per step (default 32).")
    grad_accum: int | None = option(                              # None: 1
        None, "--grad-accum", kind="int", metavar="N",
        help="Accumulate the gradients of N batches of --batch-size per optimizer step (their "
             "mean, as transformers' Trainer): N times the batch in one batch's activation "
             "memory.")
    optimizer: str | None = option(None, "--optimizer", kind="choice",
                                   choices=tuple(OPTIMIZERS), help="Default adamw.")
    lr: float | None = option(None, "--lr", kind="float", help="Learning rate (default 1e-3).")
    weight_decay: float | None = option(
        None, "--weight-decay", kind="float",
        help="L2 for sgd/momentum (default 0), decoupled for adamw (default 0.01); biases and "
             "norm weights (tensors of rank < 2) are exempt, as in transformers' Trainer.")
    weight_decay_all: bool | None = option(                       # None: rank >= 2 only
        None, "--weight-decay-all", kind="flag",
        help="Decay every tensor, biases and norm weights too (a bare torch.optim).")
    lr_schedule: str | None = option(                             # None: constant
        None, "--lr-schedule", kind="choice", choices=SCHEDULES,
        help="Learning-rate schedule after --warmup (default constant), as transformers'.")
    warmup: int | None = option(None, "--warmup", kind="int", low=0, metavar="N",
                                help="Raise the learning rate linearly from 0 over the first "
                                     "N steps.")
    clip_grad_norm: float | None = option(
        None, "--clip-grad-norm", kind="float", metavar="MAX",
        help="Scale the gradients down when their global L2 norm exceeds MAX.")
    eval_data: str | None = option(
        None, "--eval-data", kind="path", metavar="FILE.npz",
        help="Held-out arrays: their mean loss is logged, printed and plotted.")
    eval_every: int | None = option(                              # None: every epoch
        None, "--eval-every", kind="int", low=1, metavar="N",
        help="Evaluate every N steps (default: every epoch, and at the end).")
    precision: str | None = option(                               # None: the model's own
        None, "--precision", kind="choice", choices=PRECISIONS,
        help="mixed: FP16 compute, FP32 master weights; fp16: FP16 master weights too "
             "(default: fp32, mixed for a float16 model).")
    loss_scale: str | None = option(
        None, "--loss-scale", metavar="SPEC",
        help="none | static:N | dynamic[:INIT[:INTERVAL]] (default: dynamic for mixed/fp16, "
             "none for fp32).")
    device: str = option("auto", "--device", kind="choice", choices=DEVICES,   # or, from
                         show_default=True)    # Python, an executor backend (ArrayBackend)
    numerics: str = option("auto", "--numerics", kind="choice", choices=NUMERICS,
                           show_default=True,
                           help="FP16 GEMM numerics; mi200 emulates MI200 denormal flushing.")
    level: int = option(2, "--level", kind="int", low=1, high=2, show_default=True,
                        help="Rewrites applied to the training graph.")
    freeze: tuple[str, ...] = option((), "--freeze", kind="many", metavar="PATTERN",
                                     help="Do not train these weights.")
    train: tuple[str, ...] = option(
        (), "--train", kind="many", metavar="PATTERN",
        help="Train these initializers even if --freeze matches them or they look like "
             "exporter constants.")
    untie: bool | None = option(                                  # None: tied, as PyTorch
        None, "--untie", kind="flag",
        help="Train apart the copies of a weight the exporter wrote twice (a tied output "
             "projection); by default they are trained as one, as PyTorch does.")
    split_shared: bool | None = option(                           # None: split
        None, "--split-shared/--no-split-shared", kind="switch",
        help="Give each module its own copy of a parameter the exporter merged with others "
             "because they started equal (a fresh model's norms and biases): the default; "
             "--no-split-shared trains each merged tensor as one.")
    recompute: str | None = option(                               # None: none
        None, "--recompute", kind="choice", choices=RECOMPUTE_MODES,
        help="layers: keep only what enters each transformer layer for the backward pass and "
             "compute the layer's activations again there (less memory, about a third more "
             "compute, as torch.utils.checkpoint per block); default none.")
    list_params: bool = option(False, "--list-params", kind="flag",
                               help="Print what would be trained (and what not, and why), "
                                    "then exit.")
    disable: tuple[str, ...] = option((), "--disable", kind="many", metavar="RULE",
                                      help="Do not run this rule.")
    seed: int | None = option(None, "--seed", kind="int", low=0, high=2**32 - 1,
                              help="Data order and dropout seed (default 0).")
    save_graph: str | None = option(None, "--save-graph", kind="path", metavar="FILE.onnx",
                                    help="Write the rewritten training graph.")
    checkpoint: str | None = option(
        None, "--checkpoint", kind="dir", metavar="DIR",
        help="Save checkpoints here (each epoch, at the end, and on Ctrl-C).")
    checkpoint_every: int | None = option(                        # None: every epoch
        None, "--checkpoint-every", kind="int", low=1, metavar="N",
        help="Checkpoint every N steps instead of every epoch.")
    resume: bool = option(False, "--resume", kind="flag",
                          help="Continue the run saved in --checkpoint DIR, with its settings "
                               "(give --steps/--epochs to train longer).")
    allow_changed_graph: bool = option(
        False, "--allow-changed-graph", kind="flag",
        help="Resume a checkpoint written for another training graph (e.g. to fine-tune a "
             "changed head); the weights must still match by name and shape.")
    log: str | None = option(None, "--log", kind="path", metavar="FILE",
                             help="Per-step log, FILE.csv or FILE.jsonl.")
    history_rows: int = option(
        DEFAULT_CAPACITY, "--history-rows", kind="int", low=2, high=MAX_ROWS, metavar="N",
        show_default=True,
        help="Records of the loss history the summary, --plot and checkpoints keep; a "
             "longer run merges them in pairs (--log keeps every step).")
    plot: str | None = option(
        None, "--plot", kind="path", metavar="FILE.png|svg|pdf",
        help="Loss curves, raw and smoothed, and the held-out loss; the format follows the "
             "extension (needs matplotlib).")
    denormal_report: str | None = option(                         # "-": printed only
        None, "--denormal-report", kind="optional", flag_value="-", metavar="[FILE.json]",
        help="Print the nodes with the most FP16 denormals; also write JSON to FILE.")
    output: str | None = option(None, "-o", "--output", kind="path", metavar="FILE.onnx",
                                help="Write the trained model (forward graph, trained "
                                     "weights).")
    overwrite_input: bool = option(False, "--in-place", kind="flag",
                                   help="Allow -o to overwrite the input model.")
    quiet: bool = option(False, "-q", "--quiet", kind="flag",
                         help="Only errors and the interruption notice.")
    # data parallel (see .distributed): None means the default
    distributed: bool = option(
        False, "--distributed", kind="flag",
        help="Data parallel over the ranks of mpirun/mpiexec/srun (needs mpi4py); "
             "--batch-size is the global batch, split evenly across the ranks.")
    bucket_mb: float | None = option(                             # None: 25 MiB
        None, "--bucket-mb", kind="float", metavar="MIB",
        help="Gradient all-reduce bucket size with --distributed (default 25).")
    dist_timeout: float | None = option(                          # None: 300 s
        None, "--dist-timeout", kind="float", metavar="SECONDS",
        help="Abort the job when a rank is this late for a collective (default 300).")
    dist_check_every: int | None = option(                        # None: never
        None, "--dist-check-every", kind="int", low=0, metavar="K",
        help="Check that every rank holds the same weights every K steps (default 0: never).")
    dist_overlap: bool | None = option(                           # None: overlapped
        None, "--dist-overlap/--no-dist-overlap", kind="switch",
        help="All-reduce gradient buckets during the backward pass (default) or after.")


def command_line() -> list[tuple[str, object, Flag]]:
    """(field name, default, Flag) of every RunOptions field, in the command's order."""
    return [(f.name, f.default, f.metadata["cli"]) for f in fields(RunOptions)]


# -- what each kind of field holds (the Python API: the command line's parser checks the same)
_TEXT_KINDS = ("text", "path", "dir", "argument", "optional", "choice")


def checked(opts: RunOptions) -> RunOptions:
    """``opts`` with each field checked against its flag's kind (an integer for ``int``, a
    number for ``float``, text or a path for the text kinds, one of the choices, a
    list of names for ``many``, true/false for the switches), an integer's range; paths given as
    ``os.PathLike`` become text. One :class:`GraphoptError` line for the first field that
    holds something else, named as the field and as its option."""
    changes = {}
    for f in fields(opts):
        flag: Flag = f.metadata["cli"]
        value = getattr(opts, f.name)
        option = flag.names[-1].split("/")[0] if flag.kind != "argument" else f.name.upper()
        where = f"{option} (RunOptions.{f.name})"
        if value is None and f.default is not None:
            raise GraphoptError(f"{where} is None; leave it out for its default "
                                f"{f.default!r}")
        if value is None:
            continue
        kind = flag.kind
        if kind == "int":
            if isinstance(value, bool) or not isinstance(value, int):
                raise GraphoptError(f"{where} is {value!r}, not an integer")
            if (flag.low is not None and value < flag.low) or \
                    (flag.high is not None and value > flag.high):
                bound = f">= {flag.low}" if flag.high is None else \
                    f"from {flag.low} to {flag.high}" if flag.low is not None \
                    else f"<= {flag.high}"
                raise GraphoptError(f"{option} must be an integer {bound}, not {value}")
        elif kind == "float":   # (each option's range, finite included, is checked by its user)
            if isinstance(value, bool) or not isinstance(value, int | float):
                raise GraphoptError(f"{where} is {value!r}, not a number")
        elif f.name == "device" and not isinstance(value, str) and hasattr(value, "xp"):
            continue   # an executor backend, which the Session takes as it is
        elif kind in _TEXT_KINDS:
            if kind != "choice" and kind != "text" and isinstance(value, os.PathLike):
                value = changes[f.name] = os.fspath(value)
            if not isinstance(value, str):
                raise GraphoptError(f"{where} is {value!r}, not text")
            if kind == "choice" and value not in flag.choices:
                raise GraphoptError(f"{where} is {value!r}, not one of "
                                    f"{', '.join(flag.choices)}")
        elif kind == "many":
            if isinstance(value, str) or not isinstance(value, list | tuple) \
                    or not all(isinstance(v, str) for v in value):
                raise GraphoptError(f"{where} is {value!r}, not a list of names")
        elif kind in ("flag", "switch") and not isinstance(value, bool):
            raise GraphoptError(f"{where} is {value!r}, not True or False")
    return replace(opts, **changes) if changes else opts

"""The ``graphopt`` command: a thin click front end over the Python API."""
from __future__ import annotations

import functools
import os
import signal
import sys
import threading

import click

from graphopt import api, modelio
from graphopt.console import INTERRUPTED, printable
from graphopt.errors import GraphoptError, Terminated
from graphopt.profile import Profile
from graphopt.registry import all_rules
from graphopt.training.recompute import RECOMPUTE_MODES

# The library's messages name its Python parameters; on the command line the same advice
# is an option. (Python name as the library writes it, what a CLI user types instead.)
PYTHON_TO_CLI = [
    ("use device='cpu'", "use --device cpu"),
    ("device='cuda' requested", "--device cuda was asked for"),
    ("device='rocm' requested", "--device rocm was asked for"),
    ("use loss='output'", "use --loss output"),
    ("loss='cross_entropy' needs", "--loss cross_entropy needs"),
    ("(outputs=...)", "(--loss OUTPUT names a scalar loss output, --loss cross_entropy:OUTPUT "
                      "or mse:OUTPUT the prediction)"),
    ("labels_name ", "--labels "),
]


def cli_words(message: str) -> str:
    for python, cli in PYTHON_TO_CLI:
        message = message.replace(python, cli)
    return message


def echo(text="", err: bool = False) -> None:
    """click.echo, control characters in what the model or the user's files named escaped
    (tables keep their own line breaks)."""
    click.echo(printable(str(text), keep_newlines=True), err=err)


def error_line(message: str) -> None:
    """The one line of an error: control characters escaped, a newline included."""
    click.echo(f"graphopt: error: {printable(message)}", err=True)


def user_errors(command):
    """User errors become one line on stderr and exit code 1, never a traceback."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except GraphoptError as exc:
            error_line(cli_words(str(exc)))
            sys.exit(1)
        except KeyboardInterrupt as exc:
            _interrupted(exc)
        except MemoryError:
            error_line("out of memory")
            sys.exit(1)
        except OSError as exc:
            _os_error(exc)
    return wrapper


def _os_error(exc: OSError) -> None:
    """A write the command could not make outside graphopt's own writers (which say which
    file): its standard output on a full disk (``> /dev/full``), a closed pipe. One line,
    exit 1; standard output is then dropped, so the interpreter's last flush cannot fail
    again with a traceback."""
    with _quiet_stdout():
        if isinstance(exc, BrokenPipeError):   # the reader went away: nobody to tell
            sys.exit(1)
        where = f"{exc.filename}: " if exc.filename else "cannot write the output: "
        error_line(f"{where}{exc.strerror or exc}")
        sys.exit(1)


class _quiet_stdout:
    def __enter__(self):
        return self

    def __exit__(self, *exc_info):
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        except (OSError, ValueError, AttributeError):
            pass
        return False


def _interrupted(exc: BaseException) -> None:
    """One line for Ctrl-C (exit 130) or SIGTERM (exit 143), saying what was kept: a run
    stopped by a second Ctrl-C still has the checkpoints it wrote (``exc.kept``)."""
    kept = getattr(exc, "kept", None)
    if isinstance(exc, Terminated):
        click.echo(printable(f"graphopt: terminated; {kept or 'nothing was written'}"),
                   err=True)
        sys.exit(143)
    click.echo(printable(f"graphopt: interrupted; {kept}") if kept else INTERRUPTED, err=True)
    sys.exit(130)


def _terminate(signum, frame):
    raise Terminated


USAGE_EXIT = 1   # the same as every other mistake: a bad option value and a bad rule name
#                  (caught by graphopt, not click) must not exit differently


def usage_error(exc: click.UsageError) -> None:
    """One line and exit 1 for every command line mistake, in every command, instead of
    click's usage block and exit 2 (``graphopt run`` said it in one line with exit 1,
    ``optimize`` in a usage block with exit 2)."""
    ctx = exc.ctx
    command = ctx.command.name if ctx is not None and ctx.parent is not None else None
    where = f"'graphopt {command} -h'" if command else "'graphopt -h'"
    error_line(f"{exc.format_message()} (see {where})")
    sys.exit(USAGE_EXIT)


class _OneLineUsageErrors(click.Command):
    """Option errors (a bad value, an unknown option, a missing argument): one line, exit 1."""

    def parse_args(self, ctx, args):
        try:
            return super().parse_args(ctx, args)
        except click.UsageError as exc:
            usage_error(exc)


class GraphoptGroup(click.Group):
    """Click turns a Ctrl-C that lands outside a command body (while it parses arguments or
    finishes) into "Aborted!" and exit code 1; here every interrupt exits 130 with one line."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, False, **extra)
        # SIGTERM stops a command the way Ctrl-C does: clean-up runs, one line, exit 143
        previous = (signal.signal(signal.SIGTERM, _terminate)
                    if threading.current_thread() is threading.main_thread() else None)
        try:
            code = super().main(args, prog_name, complete_var, False, **extra)
        except click.UsageError as exc:
            usage_error(exc)
        except click.ClickException as exc:
            exc.show()
            sys.exit(exc.exit_code)
        except KeyboardInterrupt as exc:
            _interrupted(exc)
        except click.Abort:
            click.echo(INTERRUPTED, err=True)
            sys.exit(130)
        except OSError as exc:   # writing --help or --version to a full disk, a closed pipe
            _os_error(exc)
        finally:
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)
        sys.exit(code if isinstance(code, int) else 0)


@click.group(cls=GraphoptGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="graphopt")
def main():
    """graphopt: ONNX graph rewriting and a reference training executor."""


@main.command(cls=_OneLineUsageErrors)
@click.argument("model", type=click.Path(dir_okay=True, path_type=str))
@click.option("-o", "--output", "output", type=click.Path(path_type=str),
              help="Where to write the optimized model.")
@click.option("--level", type=click.IntRange(1, 2), default=2, show_default=True,
              help="1: standard-op rewrites; 2: also com.microsoft fusions.")
@click.option("--only", multiple=True, metavar="NAME",
              help="Run just this rule (repeatable), whatever --level says.")
@click.option("--enable", multiple=True, metavar="NAME", help="Also run this rule.")
@click.option("--disable", multiple=True, metavar="NAME", help="Do not run this rule.")
@click.option("--provider", type=click.Choice(api.PROVIDERS),
              help="Only rules that target this execution provider.")
@click.option("--input-shape", "input_shapes", multiple=True, metavar="NAME:DIM,DIM",
              help="Fix an input's dimensions before optimizing (repeatable).")
@click.option("--check", "check_runs", is_flag=False, flag_value=3, default=None,
              type=click.IntRange(min=1), metavar="[N]",
              help="Compare the original and the optimized model on N random inputs "
                   "(default 3; symbolic dims 4 unless --input-shape, token ids across the "
                   "embedding) in onnxruntime (the executor without it); exit 1 if they "
                   "differ.")
@click.option("--dry-run", is_flag=True, help="Optimize and report; write nothing.")
@click.option("--report", "report_file", type=click.Path(path_type=str),
              help="Also write the report as JSON to this file (- for stdout).")
@click.option("--explain", multiple=True, metavar="NAME",
              help="Show why this rule did not match where it almost did.")
@click.option("--in-place", is_flag=True, help="Allow overwriting the input model.")
@click.option("--reference-data", is_flag=True,
              help="Do not copy the input's external data: the output (in the input's folder) "
                   "points at its data files, which must then stay.")
@click.option("--profile", "profile", is_flag=True,
              help="Also time, peak memory and bytes read of each phase: load, each rule, type "
                   "inference, validation, save.")
@click.option("-v", "--verbose", is_flag=True,
              help="Also the rules selected and every op type's count before and after.")
@click.option("-q", "--quiet", is_flag=True, help="Only errors.")
@user_errors
def optimize(model, output, level, only, enable, disable, provider, input_shapes, check_runs,
             dry_run, report_file, explain, in_place, reference_data, profile, verbose, quiet):
    """Rewrite MODEL with the built-in (and plugin) rules."""
    if verbose and quiet:
        raise GraphoptError("-v/--verbose and -q/--quiet contradict each other")
    to_stdout = report_file == "-"
    # with --report - stdout is the JSON alone: the human-readable lines go to stderr
    say = (lambda _text: None) if quiet else functools.partial(echo, err=to_stdout)
    shapes = dict(api.parse_input_shape(text) for text in input_shapes)
    checked = []

    def check(original, optimized):
        from graphopt.executor.compare import base_dir_of
        from graphopt.executor.compare import check as compare

        result = compare(original, optimized, check_runs, base_dir=base_dir_of(model),
                         shapes=shapes)
        checked.append(result)
        if not result.ok:
            raise GraphoptError(result.format() + "; nothing written")

    phases = Profile() if profile else None
    report = api.optimize_file(model, output, in_place=in_place, dry_run=dry_run, level=level,
                               only=list(only), enable=list(enable), disable=list(disable),
                               provider=provider, explain=list(explain), input_shapes=shapes,
                               before_save=check if check_runs else None, profile=phases,
                               reference_data=reference_data,
                               also_writes={"--report": None if to_stdout else report_file})
    if verbose:
        say("rules run: " + ", ".join(report.rules))
    say(report.format_table())
    if verbose:
        say(_op_type_table(report))
    for name in explain:
        say(report.format_explain(name))
    for result in checked:
        say(result.format())
    if phases is not None:
        say(phases.format())
    if to_stdout:
        click.echo(report.to_json())
    elif report_file:
        # never onto a file the command read or the save just published (the output's
        # content-named data file included)
        protect = modelio.ProtectedFiles()
        protect.add(model, "input model")
        for path in report.written:
            protect.add(path, "optimized model's file")
        modelio.write_text_atomic(report_file, report.to_json(), "--report", protect=protect)
        say(f"wrote the report to {report_file}")
    target = model if output is None else output
    if not dry_run:
        say(f"wrote {target}")
    elif report_file and not to_stdout:
        say("dry run: only the report was written")
    else:
        say("dry run: nothing written")


def _op_type_table(report) -> str:
    before, after = report.op_types_before, report.op_types_after
    names = sorted(set(before) | set(after))
    width = max((len(n) for n in names), default=7)
    lines = [f"{'op type'.ljust(width)}  before  after"]
    lines += [f"{n.ljust(width)}  {before.get(n, 0):>6}  {after.get(n, 0):>5}" for n in names]
    return "\n".join(lines)


@main.command("rules", cls=_OneLineUsageErrors)
@user_errors
def list_rules():
    """List every rule with its level, providers and description."""
    rows = [(r.name, str(r.level), r.kind, ",".join(sorted(r.providers)), r.description)
            for r in all_rules().values()]
    header = ("name", "level", "kind", "providers", "description")
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(4)]
    for row in [header, *rows]:
        echo("  ".join(c.ljust(w) for c, w in zip(row[:4], widths, strict=True))
                   + "  " + row[4])




@main.command("run", cls=_OneLineUsageErrors)
@click.argument("model", required=False, type=click.Path(dir_okay=False, path_type=str))
@click.option("--example", metavar="NAME",
              help="Train a built-in example instead of MODEL: mqa, mlp-digits.")
@click.option("--data", metavar="FILE.npz", type=click.Path(path_type=str),
              help="Training arrays named after the graph inputs, batched along axis 0.")
@click.option("--loss", metavar="KIND|OUTPUT",
              help="cross_entropy, mse, output, or the name of a scalar graph output; "
                   "cross_entropy:OUTPUT or mse:OUTPUT picks the prediction of a model with "
                   "several outputs.")
@click.option("--labels", metavar="NAME", help="Name of the labels input cross_entropy/mse add.")
@click.option("--ignore-index", type=int, metavar="N",
              help="cross_entropy: labels equal to N do not count (default -100, as PyTorch; "
                   "padding in language-model batches). The class axis of the logits is the "
                   "one whose removal gives the labels' shape.")
@click.option("--padding-idx", type=int, metavar="N",
              help="Row N of the token embedding gets no gradient from its lookups, as "
                   "nn.Embedding(padding_idx=N) (found in dynamo exports; TorchScript drops "
                   "it).")
@click.option("--class-axis", type=int, metavar="AXIS",
              help="cross_entropy: the logits' class axis, where two axes could be (e.g. a "
                   "sequence as long as the vocabulary).")
@click.option("--steps", type=int, help="Number of optimizer steps.")
@click.option("--epochs", type=int, help="Number of passes over the data (instead of --steps).")
@click.option("--batch-size", type=int, help="Samples per step (default 32).")
@click.option("--grad-accum", type=int, metavar="N",
              help="Accumulate the gradients of N batches of --batch-size per optimizer step "
                   "(their mean, as transformers' Trainer): N times the batch in one batch's "
                   "activation memory.")
@click.option("--optimizer", type=click.Choice(["sgd", "momentum", "adamw"]),
              help="Default adamw.")
@click.option("--lr", type=float, help="Learning rate (default 1e-3).")
@click.option("--weight-decay", type=float,
              help="L2 for sgd/momentum (default 0), decoupled for adamw (default 0.01); "
                   "biases and norm weights (tensors of rank < 2) are exempt, as in "
                   "transformers' Trainer.")
@click.option("--weight-decay-all", is_flag=True,
              help="Decay every tensor, biases and norm weights too (a bare torch.optim).")
@click.option("--lr-schedule", type=click.Choice(["constant", "linear", "cosine"]),
              help="Learning-rate schedule after --warmup (default constant), as transformers'.")
@click.option("--warmup", type=click.IntRange(min=0), metavar="N",
              help="Raise the learning rate linearly from 0 over the first N steps.")
@click.option("--clip-grad-norm", type=float, metavar="MAX",
              help="Scale the gradients down when their global L2 norm exceeds MAX.")
@click.option("--eval-data", type=click.Path(path_type=str), metavar="FILE.npz",
              help="Held-out arrays: their mean loss is logged, printed and plotted.")
@click.option("--eval-every", type=click.IntRange(min=1), metavar="N",
              help="Evaluate every N steps (default: every epoch, and at the end).")
@click.option("--precision", type=click.Choice(["fp32", "mixed", "fp16"]),
              help="mixed: FP16 compute, FP32 master weights; fp16: FP16 master weights too "
                   "(default: fp32, mixed for a float16 model).")
@click.option("--loss-scale", metavar="SPEC",
              help="none | static:N | dynamic[:INIT[:INTERVAL]] (default: dynamic for "
                   "mixed/fp16, none for fp32).")
@click.option("--device", default="auto", show_default=True,
              type=click.Choice(["auto", "cpu", "cuda", "rocm"]))
@click.option("--numerics", default="auto", show_default=True,
              type=click.Choice(["auto", "native", "mi200"]),
              help="FP16 GEMM numerics; mi200 emulates MI200 denormal flushing.")
@click.option("--level", type=click.IntRange(1, 2), default=2, show_default=True,
              help="Rewrites applied to the training graph.")
@click.option("--freeze", multiple=True, metavar="PATTERN", help="Do not train these weights.")
@click.option("--train", "train_", multiple=True, metavar="PATTERN",
              help="Train these initializers even if --freeze matches them or they look like "
                   "exporter constants.")
@click.option("--untie", is_flag=True, default=None,
              help="Train apart the copies of a weight the exporter wrote twice (a tied "
                   "output projection); by default they are trained as one, as PyTorch does.")
@click.option("--split-shared/--no-split-shared", default=None,
              help="Give each module its own copy of a parameter the exporter merged with "
                   "others because they started equal (a fresh model's norms and biases): "
                   "the default; --no-split-shared trains each merged tensor as one.")
@click.option("--recompute", type=click.Choice(RECOMPUTE_MODES), default=None,
              help="layers: keep only what enters each transformer layer for the backward "
                   "pass and compute the layer's activations again there (less memory, about "
                   "a third more compute, as torch.utils.checkpoint per block); default none.")
@click.option("--list-params", is_flag=True,
              help="Print what would be trained (and what not, and why), then exit.")
@click.option("--disable", multiple=True, metavar="RULE", help="Do not run this rule.")
@click.option("--seed", type=click.IntRange(0, 2**32 - 1),
              help="Data order and dropout seed (default 0).")
@click.option("--save-graph", type=click.Path(path_type=str), metavar="FILE.onnx",
              help="Write the rewritten training graph.")
@click.option("--checkpoint", type=click.Path(file_okay=False, path_type=str), metavar="DIR",
              help="Save checkpoints here (each epoch, at the end, and on Ctrl-C).")
@click.option("--checkpoint-every", type=click.IntRange(min=1), metavar="N",
              help="Checkpoint every N steps instead of every epoch.")
@click.option("--resume", is_flag=True,
              help="Continue the run saved in --checkpoint DIR, with its settings (give "
                   "--steps/--epochs to train longer).")
@click.option("--allow-changed-graph", is_flag=True,
              help="Resume a checkpoint written for another training graph (e.g. to fine-tune "
                   "a changed head); the weights must still match by name and shape.")
@click.option("--log", "log_file", type=click.Path(path_type=str), metavar="FILE",
              help="Per-step log, FILE.csv or FILE.jsonl.")
@click.option("--plot", type=click.Path(path_type=str), metavar="FILE.png|svg|pdf",
              help="Loss curves, raw and smoothed, and the held-out loss; the format follows "
                   "the extension (needs matplotlib).")
@click.option("--denormal-report", is_flag=False, flag_value="-", default=None,
              metavar="[FILE.json]",
              help="Print the nodes with the most FP16 denormals; also write JSON to FILE.")
@click.option("-o", "--output", type=click.Path(path_type=str), metavar="FILE.onnx",
              help="Write the trained model (forward graph, trained weights).")
@click.option("--in-place", is_flag=True, help="Allow -o to overwrite the input model.")
@click.option("-q", "--quiet", is_flag=True, help="Only errors and the interruption notice.")
@click.option("--distributed", is_flag=True,
              help="Data parallel over the ranks of mpirun/mpiexec/srun (needs mpi4py); "
                   "--batch-size is the global batch, split evenly across the ranks.")
@click.option("--bucket-mb", type=float, metavar="MIB",
              help="Gradient all-reduce bucket size with --distributed (default 25).")
@click.option("--dist-timeout", type=float, metavar="SECONDS",
              help="Abort the job when a rank is this late for a collective (default 300).")
@click.option("--dist-check-every", type=click.IntRange(min=0), metavar="K",
              help="Check that every rank holds the same weights every K steps (default 0: "
                   "never).")
@click.option("--dist-overlap/--no-dist-overlap", default=None,
              help="All-reduce gradient buckets during the backward pass (default) or after.")
@user_errors
def run(model, example, data, loss, labels, steps, epochs, batch_size, grad_accum, optimizer,
        lr, weight_decay, weight_decay_all, precision, loss_scale, device, numerics, level,
        freeze, train_, disable, seed, save_graph, checkpoint, checkpoint_every, resume,
        log_file, plot, denormal_report, output, in_place, quiet, distributed, bucket_mb,
        dist_timeout, dist_check_every, dist_overlap, list_params, ignore_index, padding_idx,
        lr_schedule, warmup, clip_grad_norm, eval_data, eval_every, allow_changed_graph,
        class_axis, untie, split_shared, recompute):
    """Train MODEL (or a built-in --example) with the graphopt executor.

    \b
    graphopt run --example mqa
    graphopt run model.onnx --data train.npz --loss cross_entropy --epochs 3 -o trained.onnx
    mpiexec -n 4 graphopt run --example mqa --distributed --batch-size 64
    """
    from graphopt.trainer import RunOptions
    from graphopt.trainer import run as run_training
    from graphopt.trainer.runner import list_params as print_params

    options = RunOptions(
        model=model, example=example, data=data, loss=loss, labels=labels, steps=steps,
        epochs=epochs, batch_size=batch_size, grad_accum=grad_accum, optimizer=optimizer, lr=lr,
        weight_decay=weight_decay, weight_decay_all=weight_decay_all or None,
        precision=precision, loss_scale=loss_scale, device=device,
        numerics=numerics, level=level, freeze=freeze, train=train_, disable=disable,
        seed=seed, save_graph=save_graph, checkpoint=checkpoint,
        checkpoint_every=checkpoint_every, resume=resume,
        allow_changed_graph=allow_changed_graph, log=log_file, plot=plot,
        denormal_report=denormal_report, output=output, overwrite_input=in_place, quiet=quiet,
        distributed=distributed, bucket_mb=bucket_mb, dist_timeout=dist_timeout,
        dist_check_every=dist_check_every, dist_overlap=dist_overlap, ignore_index=ignore_index,
        padding_idx=padding_idx,
        lr_schedule=lr_schedule, warmup=warmup, clip_grad_norm=clip_grad_norm,
        eval_data=eval_data, eval_every=eval_every, class_axis=class_axis,
        untie=untie or None, split_shared=split_shared, recompute=recompute)
    if list_params:
        print_params(options, echo=echo)
        return
    outcome = run_training(options, echo=echo)
    if outcome.result.interrupted:
        sys.exit(128 + (outcome.result.stop_signal or signal.SIGINT))


if __name__ == "__main__":
    from graphopt.console import no_collection_at_exit

    try:
        main()
    finally:
        no_collection_at_exit()

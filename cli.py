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




def _click_parameter(name: str, default, flag):
    """The click decorator adding one RunOptions field's option or argument
    (trainer/options.py)."""
    if flag.kind == "argument":
        return click.argument(name, required=False,
                              type=click.Path(dir_okay=False, path_type=str))
    kinds = {"text": None, "int": int, "float": float,
             "path": click.Path(path_type=str),
             "dir": click.Path(file_okay=False, path_type=str)}
    settings: dict = {"help": flag.help or None, "metavar": flag.metavar}
    if flag.kind == "choice":
        settings["type"] = click.Choice(list(flag.choices))
    elif flag.low is not None or flag.high is not None:
        settings["type"] = click.IntRange(flag.low, flag.high)
    elif flag.kind in kinds:
        settings["type"] = kinds[flag.kind]
    if flag.kind == "flag":
        settings["is_flag"] = True
        settings["default"] = None if default is None else default
    elif flag.kind == "switch":
        settings["default"] = None
    elif flag.kind == "many":
        settings["multiple"] = True
    elif flag.kind == "optional":
        settings.update(is_flag=False, flag_value=flag.flag_value, default=None)
    else:
        settings["default"] = default
    if flag.show_default:
        settings["show_default"] = True
    return click.option(*flag.names, name, **settings)


def _run_options(command):
    """Decorate ``command`` with one option per RunOptions field, in the fields' order."""
    from graphopt.trainer.options import command_line

    for name, default, flag in reversed(command_line()):   # decorators apply bottom-up
        command = _click_parameter(name, default, flag)(command)
    return command


@main.command("run", cls=_OneLineUsageErrors)
@_run_options
@user_errors
def run(**values):
    """Train MODEL (or a built-in --example) with the graphopt executor.

    \b
    graphopt run --example mqa
    graphopt run model.onnx --data train.npz --loss cross_entropy --epochs 3 -o trained.onnx
    mpiexec -n 4 graphopt run --example mqa --distributed --batch-size 64
    """
    from graphopt.trainer import RunOptions
    from graphopt.trainer import run as run_training
    from graphopt.trainer.runner import list_params as print_params

    for name in ("untie", "weight_decay_all"):   # a flag left out is "not given" (None)
        values[name] = values[name] or None
    for name in ("freeze", "train", "disable"):
        values[name] = tuple(values[name])
    options = RunOptions(**values)
    if options.list_params:
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

"""The ``graphopt`` command: a thin click front end over the Python API."""
from __future__ import annotations

import functools
import sys

import click

from graphopt import api, modelio
from graphopt.errors import GraphoptError
from graphopt.registry import all_rules


def user_errors(command):
    """User errors become one line on stderr and exit code 1, never a traceback."""

    @functools.wraps(command)
    def wrapper(*args, **kwargs):
        try:
            return command(*args, **kwargs)
        except GraphoptError as exc:
            click.echo(f"graphopt: error: {exc}", err=True)
            sys.exit(1)
        except KeyboardInterrupt:
            click.echo("graphopt: interrupted; nothing was written", err=True)
            sys.exit(130)
        except MemoryError:
            click.echo("graphopt: error: out of memory", err=True)
            sys.exit(1)
    return wrapper


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="graphopt")
def main():
    """graphopt: ONNX graph rewriting and a reference training executor."""


@main.command()
@click.argument("model", type=click.Path(dir_okay=True, path_type=str))
@click.option("-o", "--output", "output", type=click.Path(path_type=str),
              help="Where to write the optimized model.")
@click.option("--level", type=click.IntRange(1, 2), default=2, show_default=True,
              help="1: standard-op rewrites; 2: also com.microsoft fusions.")
@click.option("--enable", multiple=True, metavar="NAME", help="Also run this rule.")
@click.option("--disable", multiple=True, metavar="NAME", help="Do not run this rule.")
@click.option("--provider", type=click.Choice(api.PROVIDERS),
              help="Only rules that target this execution provider.")
@click.option("--dry-run", is_flag=True, help="Optimize and report; write nothing.")
@click.option("--report", "report_file", type=click.Path(path_type=str),
              help="Also write the report as JSON to this file.")
@click.option("--explain", multiple=True, metavar="NAME",
              help="Show why this rule did not match where it almost did.")
@click.option("--in-place", is_flag=True, help="Allow overwriting the input model.")
@user_errors
def optimize(model, output, level, enable, disable, provider, dry_run, report_file, explain,
             in_place):
    """Rewrite MODEL with the built-in (and plugin) rules."""
    if report_file:
        modelio.check_output_path(report_file, model, in_place=False)
    report = api.optimize_file(model, output, in_place=in_place, dry_run=dry_run, level=level,
                               enable=list(enable), disable=list(disable), provider=provider,
                               explain=list(explain))
    click.echo(report.format_table())
    for name in explain:
        click.echo(report.format_explain(name))
    if report_file:
        modelio.write_text_atomic(report_file, report.to_json())
    target = model if output is None else output
    click.echo("dry run: nothing written" if dry_run else f"wrote {target}")


@main.command("rules")
@user_errors
def list_rules():
    """List every rule with its level, providers and description."""
    rows = [(r.name, str(r.level), r.kind, ",".join(sorted(r.providers)), r.description)
            for r in all_rules().values()]
    header = ("name", "level", "kind", "providers", "description")
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(4)]
    for row in [header, *rows]:
        click.echo("  ".join(c.ljust(w) for c, w in zip(row[:4], widths)) + "  " + row[4])


if __name__ == "__main__":
    main()

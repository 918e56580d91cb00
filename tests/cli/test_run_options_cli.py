"""`graphopt run`'s options are RunOptions' fields: one source (trainer/options.py) for the
command line and the Python API, so neither can gain an option the other lacks."""
from __future__ import annotations

import re
from dataclasses import fields

from support.cli_runs import invoke

from graphopt.trainer import RunOptions
from graphopt.trainer.options import command_line


def _raw_help() -> str:
    result = invoke("run", "--help")
    assert result.exit_code == 0
    return result.stdout


def _help() -> str:
    return re.sub(r"\s+", " ", _raw_help())


def _listed_flags() -> set[str]:
    """The flags at the head of the help's option lines (``-o, --output FILE.onnx``)."""
    flags = set()
    for line in _raw_help().split("Options:", 1)[1].splitlines():
        head = re.match(r"^  (-\S.*?)(?: {2,}|$)", line)
        if head:
            for part in re.split(r", | / ", head.group(1)):
                flags.add(part.split(" ")[0])
    return flags


def test_every_field_is_an_option_and_every_option_a_field():
    text = _help()
    listed = _listed_flags()
    flags = {"-h", "--help"}
    for name, _, flag in command_line():
        if flag.kind == "argument":
            assert f"[{name.upper()}]" in text
            continue
        for names in flag.names:
            flags.update(part for part in names.split("/"))
    assert listed == flags
    assert [f.name for f in fields(RunOptions)] == [name for name, _, _ in command_line()]


def test_each_options_help_is_its_fields():
    text = _help()
    for _, _, flag in command_line():
        if flag.help:
            assert re.sub(r"\s+", " ", flag.help) in text.replace("- ", "-"), flag.names

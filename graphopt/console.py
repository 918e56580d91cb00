"""The ``graphopt`` console script.

Ctrl-C while Python imports onnx, protobuf and numpy can print a traceback or even crash
inside an extension module's initialisation. So the interrupt is held back until the
imports are done, and then ends the program the way any other interrupt does: one line on
stderr, exit code 130. And the interpreter's collections at exit are skipped
(``no_collection_at_exit``).
"""
from __future__ import annotations

import gc
import os
import re
import signal
import sys

INTERRUPTED = "graphopt: interrupted; nothing was written"

# C0 and C1 control characters and DEL (a newline would inject a line into a one-line
# error, ESC starts a terminal escape sequence), and the Unicode format characters that
# reorder or hide text on a terminal (bidi overrides, zero-width marks)
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f\u200b-\u200f\u202a-\u202e\u2066-\u2069"
                      "\ufeff]")
_CONTROL_KEEPING_LINES = re.compile("[\x00-\x09\x0b-\x1f\x7f-\x9f\u200b-\u200f"
                                    "\u202a-\u202e\u2066-\u2069\ufeff]")


def printable(text: str, *, keep_newlines: bool = False) -> str:
    """``text`` with control characters escaped as ``repr`` writes them (``\\n``,
    ``\\x1b``, ``\\u202e``): a name read from a model or a file cannot add a line to a
    message or send escape sequences to the user's terminal. ``keep_newlines``: for
    multi-line output (tables), whose own line breaks stay."""
    pattern = _CONTROL_KEEPING_LINES if keep_newlines else _CONTROL
    return pattern.sub(lambda m: repr(m.group())[1:-1], text)


def main() -> None:
    held_back: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: held_back.append(signum))
    try:
        from graphopt.cli import main as cli_main
    except ModuleNotFoundError as exc:
        if not (exc.name or "").startswith("graphopt."):
            raise
        # a copy of the graphopt/ folder without the folders setup.cfg maps in beside it
        # (executor/, trainer/, rules/): graphopt/__init__.py finds them in a full checkout
        sys.stderr.write(
            f"graphopt: error: {exc.name} is missing: this Python imported graphopt from the "
            f"source folder {os.path.dirname(os.path.dirname(__file__))}, not from an "
            "installed graphopt; install it (pip install .) and run the graphopt command, "
            "or python -P -m graphopt\n")
        sys.exit(1)
    finally:
        signal.signal(signal.SIGINT, previous)
    if held_back:
        sys.stderr.write(INTERRUPTED + "\n")
        sys.exit(130)
    try:
        cli_main()
    finally:
        no_collection_at_exit()


def no_collection_at_exit() -> None:
    """For a process that exits next, once its command has closed what it wrote: what the
    interpreter's garbage collections at exit would free, the process is about to give
    back anyway. With numba's code generator loaded (the executor's compiled kernels) they
    walk some 120,000 objects: about 70 ms of `graphopt run`'s exit, 12 ms with the
    objects frozen (the collector skips them; atexit handlers still run, and stdout and
    stderr are still flushed). Never in a process that goes on (CliRunner's tests)."""
    gc.freeze()


if __name__ == "__main__":
    main()

"""The ``graphopt`` console script.

Ctrl-C while Python imports onnx, protobuf and numpy can print a traceback or even crash
inside an extension module's initialisation. So the interrupt is held back until the
imports are done, and then ends the program the way any other interrupt does: one line on
stderr, exit code 130.
"""
from __future__ import annotations

import signal
import sys

INTERRUPTED = "graphopt: interrupted; nothing was written"


def main() -> None:
    held_back: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: held_back.append(signum))
    try:
        from graphopt.cli import main as cli_main
    finally:
        signal.signal(signal.SIGINT, previous)
    if held_back:
        sys.stderr.write(INTERRUPTED + "\n")
        sys.exit(130)
    cli_main()


if __name__ == "__main__":
    main()

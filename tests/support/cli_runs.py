"""The `graphopt` command run in-process, and the one-error-line promise checked on it."""
from __future__ import annotations

from click.testing import CliRunner

from graphopt.cli import main


def invoke(*args):
    """`graphopt ARGS` in-process (click's Result: exit_code, stdout, stderr, exception)."""
    return CliRunner().invoke(main, [str(a) for a in args])


def one_error_line(result, *contains: str) -> str:
    """Exit 1 and exactly one stderr line, ``graphopt: error: ...`` holding each of
    ``contains``; returns the line."""
    assert result.exit_code == 1, (result.exit_code, result.output, result.exception)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("graphopt: error: "), result.stderr
    for text in contains:
        assert text in lines[0], lines[0]
    return lines[0]


def cli(*args) -> tuple[int, str, str]:
    """`graphopt ARGS` in-process: (exit code, stdout, stderr); an exception escaping the
    command (a traceback for the user) fails the test here."""
    result = invoke(*args)
    if result.exception is not None and not isinstance(result.exception, SystemExit):
        raise AssertionError(f"uncaught {type(result.exception).__name__}: {result.exception}")
    return result.exit_code, result.stdout, result.stderr


def assert_one_error_line(code: int, stderr: str, *expected: str) -> str:
    """:func:`one_error_line` for what :func:`cli` returns; no traceback either."""
    lines = stderr.strip().splitlines()
    assert code == 1 and len(lines) == 1, (code, stderr)
    assert lines[0].startswith("graphopt: error: ") and "Traceback" not in stderr, stderr
    for text in expected:
        assert text in lines[0], lines[0]
    return lines[0]

"""What a run shows while it trains: a one-line progress bar on a terminal, plain lines
otherwise (CI logs, pipes), and the per-step log file (CSV or JSON lines)."""
from __future__ import annotations

import contextlib
import csv
import io
import json
import os
import sys
import time
from collections.abc import Callable

from graphopt import modelio
from graphopt.errors import GraphoptError

LOG_FIELDS = ("step", "epoch", "loss", "perplexity", "loss_scale", "skipped", "applied",
              "seconds", "lr", "grad_norm", "eval_loss", "eval_perplexity", "eval_accuracy")


class Progress:
    """``echo(text)`` writes a line. On a terminal the bar is redrawn in place (``\\r``)."""

    def __init__(self, total: int, start: int = 0, unit: str = "samples", *,
                 stream=None, every: int | None = None, echo: Callable[[str], None] = print):
        self.stream = stream if stream is not None else sys.stderr
        self.is_tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.total, self.start, self.unit = total, start, unit
        self.every = every or max(1, (total - start) // 20)
        self.echo = echo
        self.started = time.perf_counter()
        self.done_items = 0
        self._last_draw = 0.0

    def update(self, step: int, loss: float, items: int, skipped: int, scale: float) -> None:
        """``step`` is the number of steps finished (1-based)."""
        self.done_items += items
        elapsed = time.perf_counter() - self.started
        rate = self.done_items / elapsed if elapsed > 0 else 0.0
        scale_text = f"  scale {scale:g}" if scale != 1.0 else ""
        status = (f"loss {loss:.4f}  {rate:,.0f} {self.unit}/s  skipped {skipped}{scale_text}")
        if self.is_tty:
            now = time.perf_counter()
            if now - self._last_draw < 0.1 and step < self.total:
                return
            self._last_draw = now
            width = 24
            filled = int(width * step / max(self.total, 1))
            bar = "#" * filled + "-" * (width - filled)
            self.stream.write(f"\r[{bar}] {step}/{self.total}  {status}\x1b[K")
            self.stream.flush()
        elif step == self.total or step == self.start + 1 or (step - self.start) % self.every == 0:
            self.echo(f"step {step}/{self.total}  {status}")

    def note(self, text: str) -> None:
        """A line of its own between progress updates (the bar is redrawn by the next one)."""
        if self.is_tty:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self._last_draw = 0.0
        self.echo(text)

    def close(self) -> None:
        if self.is_tty:
            self.stream.write("\n")
            self.stream.flush()


class StepLog:
    """Appends one record per step to FILE.csv or FILE.jsonl (flushed each step, so an
    interrupted run keeps its log; a resumed run appends).

    A write that fails (a full disk, a quota) keeps what was there before the run: an
    appended log is cut back to its last whole record, and a new log that replaced an earlier
    file puts that file back (kept under a hidden hard link while the run writes, removed
    when the log closes)."""

    def __init__(self, path: str, append: bool = False):
        ext = os.path.splitext(path)[1].lower()
        if ext not in (".csv", ".jsonl"):
            raise GraphoptError(f"--log {path}: use a .csv or .jsonl file name")
        self.kind = ext[1:]
        folder = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(folder):
            raise GraphoptError(f"--log {path}: folder {folder} does not exist")
        fresh = not (append and os.path.exists(path))
        self.path = path
        self._previous = _keep_previous(path) if fresh else None
        # a new file renamed onto the path (or the path's own file appended to): never the
        # file a symlink or another hard link points at, never a FIFO
        self.file = modelio.open_for_appending(path, "--log", append=not fresh)
        # records go to the descriptor whole, each in one write, never through a buffer: a
        # failed write leaves nothing behind that a later flush could add
        self._fd = self.file.fileno()
        self._line = io.StringIO()   # one record's text, formatted by csv before its write
        self._row_writer = csv.DictWriter(self._line, LOG_FIELDS)
        self._whole = os.fstat(self._fd).st_size   # the end of the last whole record
        if self.kind == "csv" and fresh:
            try:
                self._append(",".join(LOG_FIELDS) + "\r\n", "its header")
            except GraphoptError:
                self.close()
                raise

    def write(self, record: dict) -> None:
        values = {k: record.get(k) for k in LOG_FIELDS}
        if self.kind == "csv":
            self._line.seek(0)
            self._line.truncate()
            self._row_writer.writerow(values)
            line = self._line.getvalue()
        else:
            line = json.dumps(values) + "\n"
        self._append(line, f"step {record.get('step')}")

    def _append(self, text: str, what: str) -> None:
        data = text.encode("utf-8")
        try:
            written = 0
            while written < len(data):
                written += _write(self._fd, data[written:])
            self._whole += len(data)
        except OSError as exc:   # disk full, quota: one line, like a failed checkpoint save
            kept = self._undo()
            raise GraphoptError(f"--log {self.path}: cannot write {what}: "
                                f"{exc.strerror or exc}; {kept}") from None

    def _undo(self) -> str:
        """Back to what the path held before this run; says what that is."""
        if self._previous is not None:
            with contextlib.suppress(OSError):
                os.replace(self._previous, self.path)
                self._previous = None
                return "the earlier log is kept"
        with contextlib.suppress(OSError):
            os.ftruncate(self._fd, self._whole)
        return "the log keeps its whole records"

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.file.close()   # (nothing buffered: every record went to the descriptor)
        if self._previous is not None:
            with contextlib.suppress(OSError):
                os.unlink(self._previous)
            self._previous = None


_write = os.write   # (the tests fill the disk here)


def _keep_previous(path: str) -> str | None:
    """A hidden hard link beside ``path`` to what it names now (a file, or a symlink itself),
    so that a failed new log can put it back; None when there is nothing there or the file
    system has no hard links."""
    if not os.path.lexists(path):
        return None
    folder, name = os.path.split(os.path.abspath(path))
    kept = os.path.join(folder, f".{name}.previous-{os.getpid()}")
    try:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(kept)
        os.link(path, kept, follow_symlinks=False)
    except OSError:
        return None
    return kept

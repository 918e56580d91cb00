"""The run's loss history, bounded: what the summary, the plot and the checkpoint keep of
every step, in at most ``capacity`` rows however long the run.

Each row is one step's record (step, epoch, loss, loss scale, skipped-step count, applied,
seconds; lr, grad_norm, perplexity, nonfinite and eval_* where the run records them) until
the history holds ``capacity`` rows. Then neighbouring rows are merged in pairs and each row
covers twice as many steps (``stride``): a row of several steps carries ``steps`` (how many),
the mean loss of its applied steps (the loss of its last step where none was applied), the
summed seconds, and the last value of everything else; ``applied`` is false and
``nonfinite`` names the last kind where any of its steps was skipped. Every row but the last
covers exactly ``stride`` steps, so row ``i`` ends at step ``min((i + 1) * stride, step)``.

A long run thus costs a fixed amount of memory and checkpoint metadata (``capacity`` rows:
about 1 KB each in memory, 0.7 KB in the checkpoint's metadata, which stores 4 bytes a
character), and its plot keeps the run's whole
shape at uniform resolution; every step's own record is in ``--log``. The first step's loss
is kept exactly for the summary (``first_loss``).
"""
from __future__ import annotations

from collections.abc import Iterator, Sequence

from .metrics import perplexity

DEFAULT_CAPACITY = 4096
MAX_ROWS = 65536   # --history-rows' bound: the checkpoint's metadata stays under 64 MiB


class History(Sequence):
    """The rows of the run's history (see the module's text); a sequence of dicts."""

    def __init__(self, capacity: int = DEFAULT_CAPACITY, rows: list[dict] | None = None,
                 stride: int = 1, first_loss: float | None = None):
        if capacity < 2:
            raise ValueError(f"a history keeps at least 2 rows, not {capacity}")
        self.capacity = capacity
        self.stride = stride
        self._rows: list[dict] = list(rows or [])
        self.first_loss = first_loss if first_loss is not None else \
            (self._rows[0]["loss"] if self._rows and stride == 1 else None)
        # the last step's own loss (a resumed history's last row stands in until a step)
        self.last_loss = self._rows[-1]["loss"] if self._rows else None
        while len(self._rows) > capacity:
            self._halve()

    # -- the sequence of rows -------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._rows)

    def __getitem__(self, index):
        return self._rows[index]

    def __iter__(self) -> Iterator[dict]:
        return iter(self._rows)

    @property
    def losses(self) -> list[float]:
        """The rows' losses: every step's own loss while ``stride`` is 1."""
        return [row["loss"] for row in self._rows]

    # -- growing ---------------------------------------------------------------------------
    def append(self, record: dict) -> None:
        """One step's record (a copy is kept); its step follows the last one."""
        record = dict(record)
        if self.first_loss is None:
            self.first_loss = record["loss"]
        self.last_loss = record["loss"]
        if len(self._rows) == self.capacity and self._steps_in(-1) == self.stride:
            self._halve()
        if self._rows and self._steps_in(-1) < self.stride:   # the last row is not full
            before = self._rows[-2]["skipped"] if len(self._rows) > 1 else 0
            self._rows[-1] = merged(self._rows[-1], record, before)
            return
        self._rows.append(record)   # (a row without "steps" covers one)

    def note_evaluation(self, evaluation: dict) -> None:
        """The held-out results measured after the last step, on its row."""
        self._rows[-1].update(evaluation)

    def _steps_in(self, index: int) -> int:
        return self._rows[index].get("steps", 1)

    def _halve(self) -> None:
        """Merge rows (0, 1), (2, 3), ...: every row then covers twice the steps."""
        rows = []
        for index in range(0, len(self._rows), 2):
            before = rows[-1]["skipped"] if rows else 0
            pair = self._rows[index:index + 2]
            rows.append(merged(*pair, before) if len(pair) == 2 else dict(pair[0]))
        self._rows = rows
        self.stride *= 2


def merged(earlier: dict, later: dict, skipped_before: int) -> dict:
    """One row of two neighbouring ones; ``skipped_before``: the skipped-step count before
    ``earlier``'s first step."""
    counts = earlier.get("steps", 1), later.get("steps", 1)
    applied = (counts[0] - (earlier["skipped"] - skipped_before),
               counts[1] - (later["skipped"] - earlier["skipped"]))
    row = dict(later)
    row["steps"] = counts[0] + counts[1]
    if sum(applied):   # the mean loss of the steps that trained
        row["loss"] = (earlier["loss"] * applied[0] if applied[0] else 0.0) \
            + (later["loss"] * applied[1] if applied[1] else 0.0)
        row["loss"] /= sum(applied)
    row["seconds"] = round(earlier["seconds"] + later["seconds"], 6)
    row["applied"] = earlier["applied"] and later["applied"]
    kind = later.get("nonfinite") or earlier.get("nonfinite")
    if kind:
        row["nonfinite"] = kind
    for key in ("grad_norm", "eval_loss", "eval_accuracy", "eval_perplexity"):
        if key not in row and key in earlier:   # the later step's own value, else the earlier
            row[key] = earlier[key]
    if "perplexity" in row:
        row["perplexity"] = perplexity(row["loss"])
    return row

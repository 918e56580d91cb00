"""Checkpoints: one ``checkpoint.npz`` per directory, written atomically.

Contents: the master weights (``param/<name>``), the optimizer's arrays (``opt/<name>/<slot>``)
and a JSON ``__meta__`` with the step, epoch, batch position, data seed and size, batch
size, optimizer scalars, loss-scaler state and the loss history. The data order is a pure
function of (seed, epoch) (see :mod:`.data`), so step + seed pin the next batch exactly.

Atomic: written to a temporary file in the same directory, fsynced, renamed over the old
checkpoint, then the directory is fsynced, so a crash leaves the old or the new checkpoint,
never a torn one.
"""
from __future__ import annotations

import contextlib
import json
import os
import tempfile
import zipfile
from dataclasses import dataclass, field

import numpy as np

from graphopt.errors import GraphoptError

FILENAME = "checkpoint.npz"
FORMAT = 1


@dataclass
class Checkpoint:
    step: int
    params: dict[str, np.ndarray]
    optimizer: dict                   # JSON-able scalars
    optimizer_arrays: dict[str, np.ndarray]
    scaler: dict
    data: dict                        # seed, size, batch_size, epoch, batch_in_epoch
    history: list[dict] = field(default_factory=list)
    precision: str = "fp32"


def path_in(directory: str) -> str:
    return os.path.join(directory, FILENAME)


def save(directory: str, checkpoint: Checkpoint) -> str:
    os.makedirs(directory, exist_ok=True)
    meta = {"format": FORMAT, "step": checkpoint.step, "optimizer": checkpoint.optimizer,
            "scaler": checkpoint.scaler, "data": checkpoint.data,
            "history": checkpoint.history, "precision": checkpoint.precision,
            "params": list(checkpoint.params)}
    arrays = {f"param/{k}": v for k, v in checkpoint.params.items()}
    arrays.update({f"opt/{k}": v for k, v in checkpoint.optimizer_arrays.items()})
    arrays["__meta__"] = np.array(json.dumps(meta))
    target = path_in(directory)
    fd, tmp = tempfile.mkstemp(prefix=".checkpoint-", suffix=".npz.tmp", dir=directory)
    try:
        with os.fdopen(fd, "wb") as f:
            np.savez(f, **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_directory(directory)
    return target


def _fsync_directory(directory: str) -> None:
    with contextlib.suppress(OSError):  # not every file system lets a directory be opened
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def load(directory: str) -> Checkpoint:
    target = path_in(directory)
    if not os.path.isfile(target):
        raise GraphoptError(f"--resume: no checkpoint in {directory} ({FILENAME} is missing)")
    try:
        with np.load(target, allow_pickle=False) as archive:
            meta = json.loads(str(archive["__meta__"]))
            params = {k[len("param/"):]: archive[k] for k in archive.files
                      if k.startswith("param/")}
            optimizer_arrays = {k[len("opt/"):]: archive[k] for k in archive.files
                                if k.startswith("opt/")}
    except (OSError, ValueError, KeyError, zipfile.BadZipFile) as exc:
        raise GraphoptError(f"{target}: not a readable checkpoint ({exc})") from None
    if meta.get("format") != FORMAT:
        raise GraphoptError(f"{target}: checkpoint format {meta.get('format')} is not {FORMAT}")
    params = {name: params[name] for name in meta["params"]}  # model order
    return Checkpoint(meta["step"], params, meta["optimizer"], optimizer_arrays, meta["scaler"],
                      meta["data"], meta.get("history", []), meta.get("precision", "fp32"))

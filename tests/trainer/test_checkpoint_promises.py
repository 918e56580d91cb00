"""Checkpoint durability promises: the data reaches the disk (fsync) before the rename makes
it the checkpoint, the directory entry is synced after it, and the clean-up of temporary
files left by killed writers never touches the file of a writer that is still alive."""
from __future__ import annotations

import os

import numpy as np

from graphopt import modelio
from graphopt.trainer import checkpoint as ckpt


def _checkpoint(step: int = 3) -> ckpt.Checkpoint:
    return ckpt.Checkpoint(step=step, params={"w": np.arange(6, dtype=np.float32)},
                           optimizer={"name": "sgd"}, optimizer_arrays={}, scaler={},
                           data={"seed": 1})


def test_the_file_is_fsynced_before_the_rename_and_the_directory_after(tmp_path, monkeypatch):
    events = []
    real_fsync, real_replace = os.fsync, os.replace

    def fsync(fd):
        info = os.fstat(fd)
        events.append(("fsync", (info.st_dev, info.st_ino)))
        real_fsync(fd)

    def replace(src, dst, *args, **kwargs):
        info = os.stat(src)
        events.append(("replace", (info.st_dev, info.st_ino)))
        real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    target = ckpt.save(str(tmp_path), _checkpoint())
    replaces = [i for i, (kind, _) in enumerate(events) if kind == "replace"]
    assert len(replaces) == 1
    at = replaces[0]
    file_id = events[at][1]
    assert ("fsync", file_id) in events[:at], events  # the data is on disk before the rename
    directory = os.stat(tmp_path)
    assert ("fsync", (directory.st_dev, directory.st_ino)) in events[at + 1:], events
    assert ckpt.read_step(str(tmp_path)) == 3 and os.path.basename(target) == ckpt.FILENAME


def _temp_name(pid: int) -> str:
    return f"{ckpt.TEMP_PREFIX}{modelio.host_tag()}-{pid}-abc{ckpt.TEMP_SUFFIX}"


def _dead_pid() -> int:
    """A pid no process has: one past the highest, checked."""
    pid = 4_000_000
    while True:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return pid
        except OSError:
            pass
        pid += 1


def test_a_live_writers_temporary_file_survives_the_clean_up(tmp_path):
    live = tmp_path / _temp_name(os.getppid())  # our parent: alive, and not us
    live.write_bytes(b"being written")
    ours = tmp_path / _temp_name(os.getpid())  # another save of this process, in flight
    ours.write_bytes(b"ours, being written")
    dead = tmp_path / _temp_name(_dead_pid())
    dead.write_bytes(b"left by a killed writer")
    other_host = tmp_path / f"{ckpt.TEMP_PREFIX}{modelio.host_tag()}x-1-abc{ckpt.TEMP_SUFFIX}"
    other_host.write_bytes(b"another host's writer")
    ckpt.save(str(tmp_path), _checkpoint())
    assert live.exists() and live.read_bytes() == b"being written"
    assert ours.exists()
    assert not dead.exists()
    assert other_host.exists()

"""Checkpoints: one ``checkpoint.npz`` per directory, written atomically.

Contents: the master weights (``param/<name>``), the optimizer's arrays (``opt/<name>/<slot>``)
and a JSON ``__meta__`` with the step, epoch, batch position, data seed and size, batch
size, optimizer scalars, loss-scaler state and the loss history. The data order is a pure
function of (seed, epoch) (see :mod:`.data`), so step + seed pin the next batch exactly.

Atomic: written to a hidden temporary file in the same directory, fsynced, renamed over the
old checkpoint, then the directory is fsynced, so a crash (SIGKILL, power loss) leaves the old
or the new checkpoint, never a torn one; the previous checkpoint is kept until the new one is
complete. A write that fails (disk full, quota, I/O error) removes its temporary file, keeps
the previous checkpoint and raises one :class:`CheckpointWriteError` line saying so. The
temporary files a killed writer could not remove (``.checkpoint-<host>-<pid>-*.npz.tmp``) are
removed by the next successful save on that host once their process is gone. Only a regular
file (or nothing) is replaced, and only a regular file is read: a FIFO, device or folder under
the checkpoint's name (or the lock's) is refused in one line, never opened for a blocking read.

:func:`load` accepts only a complete checkpoint: a truncated or damaged file (the zip CRCs
cover every array) or inconsistent metadata is refused with one line naming the file. It
reads the names, dtypes and shapes of the arrays from the zip's and the .npy headers first and
checks them (and, given the run's expectations, against the training graph) before any array
data is decompressed: a small file declaring huge arrays costs nothing to refuse.

Runs without ``--checkpoint`` save on Ctrl-C into a folder of their own
(:func:`claim_run_folder`): ``<model>-<run id>`` under ./graphopt-checkpoint/, the run id a
short hash of the training graph's fingerprint, the saved settings and the data's seed and
size, so a Ctrl-C of one run never replaces the checkpoint another run left there.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import os
import socket
import stat
import time
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from graphopt import modelio
from graphopt.errors import GraphoptError
from graphopt.modelio import _kind, file_mode_for, open_regular, process_alive, refuse_special_file

from .optimizers import OPTIMIZERS

FILENAME = "checkpoint.npz"
FORMAT = 1
# a checkpoint's temporary file is modelio's (.checkpoint.npz.graphopt-<host>-<pid>-XXXX.tmp):
# one stale-temporary policy for every file graphopt writes
TEMP_PREFIX = f".{FILENAME}.{modelio.TEMP_TAG}-"
TEMP_SUFFIX = modelio.TEMP_SUFFIX


class CheckpointWriteError(GraphoptError):
    """A checkpoint could not be written; the previous one (if any) is untouched."""


@dataclass
class Checkpoint:
    step: int
    params: dict[str, np.ndarray]
    optimizer: dict                   # JSON-able scalars
    optimizer_arrays: dict[str, np.ndarray]
    scaler: dict
    data: dict                        # seed, size, batch_size, epoch, batch_in_epoch
    history: list[dict] = field(default_factory=list)   # rows (see .history)
    precision: str = "fp32"
    settings: dict = field(default_factory=dict)   # the run's options, for a bare --resume
    graph: str | None = None          # fingerprint of the training graph (see .fingerprint)
    buffers: dict[str, np.ndarray] = field(default_factory=dict)   # running statistics
    history_stride: int = 1           # steps a history row covers (all rows but the last)
    first_loss: float | None = None   # the first step's own loss
    nonfinite: dict[str, int] = field(default_factory=dict)   # skipped steps per kind
    blas_threads: int | None = None   # the CPU BLAS threads of the run's large products


def path_in(directory: str) -> str:
    return os.path.join(directory, FILENAME)


def _write_archive(f, arrays: dict) -> None:
    """The bytes of the checkpoint (a plain .npz; the tests inject write faults here)."""
    np.savez(f, **arrays)


def save(directory: str, checkpoint: Checkpoint) -> str:
    meta = {"format": FORMAT, "step": checkpoint.step, "optimizer": checkpoint.optimizer,
            "scaler": checkpoint.scaler, "data": checkpoint.data,
            "history": list(checkpoint.history), "history_stride": checkpoint.history_stride,
            "first_loss": checkpoint.first_loss, "nonfinite": checkpoint.nonfinite,
            "blas_threads": checkpoint.blas_threads,
            "precision": checkpoint.precision,
            "settings": checkpoint.settings, "graph": checkpoint.graph,
            "params": list(checkpoint.params),
            "optimizer_arrays": list(checkpoint.optimizer_arrays)}
    if checkpoint.buffers:
        meta["buffers"] = list(checkpoint.buffers)
    arrays = {f"param/{k}": v for k, v in checkpoint.params.items()}
    arrays.update({f"buffer/{k}": v for k, v in checkpoint.buffers.items()})
    arrays.update({f"opt/{k}": v for k, v in checkpoint.optimizer_arrays.items()})
    arrays["__meta__"] = np.array(json.dumps(meta))
    target = path_in(directory)
    try:
        refuse_special_file(target, "checkpoint")
    except GraphoptError as exc:
        raise CheckpointWriteError(str(exc)) from None
    tmp = None
    try:
        os.makedirs(directory, exist_ok=True)
        tmp = modelio.temporary_file(directory, FILENAME, file_mode_for(target))
        with open(tmp, "wb") as f:
            _write_archive(f, arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
        tmp = None
    except OSError as exc:
        raise CheckpointWriteError(_write_failure(directory, checkpoint.step, exc)) from None
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
    _fsync_directory(directory)
    modelio.remove_stale_temporaries(directory, FILENAME)
    return target


def _write_failure(directory: str, step: int, exc: OSError) -> str:
    reason = exc.strerror or str(exc) or type(exc).__name__
    if exc.errno is not None and exc.errno in errno.errorcode:
        reason = f"{reason} ({errno.errorcode[exc.errno]})"
    return f"could not save the checkpoint of step {step} in {directory}: {reason}; " \
           f"{describe_existing(directory)}"


def describe_existing(directory: str) -> str:
    """What the last complete checkpoint in ``directory`` is, in words."""
    target = path_in(directory)
    if not os.path.isfile(target):
        return f"no earlier checkpoint exists in {directory}"
    try:
        step = read_step(directory)
    except GraphoptError:
        return f"{target} was left as it was"
    return f"the previous checkpoint {target} (step {step}) is intact"


META = "__meta__"


@dataclass(frozen=True)
class Declared:
    """An array of a checkpoint as its .npy header declares it (nothing decompressed yet)."""
    dtype: np.dtype
    shape: tuple[int, ...]
    info: zipfile.ZipInfo


class _Counting:
    """A reader that counts the bytes read through it (the .npy header's length)."""

    def __init__(self, f):
        self.f, self.count = f, 0

    def read(self, size: int = -1) -> bytes:
        data = self.f.read(size)
        self.count += len(data)
        return data


def _open_archive(target: str) -> zipfile.ZipFile:
    """The checkpoint's zip, opened only if it is a regular file (never blocking on a FIFO)."""
    fd, _ = open_regular(target, "checkpoint")
    f = os.fdopen(fd, "rb")
    try:
        return zipfile.ZipFile(f)
    except BaseException:
        f.close()
        raise


def _headers(archive: zipfile.ZipFile) -> dict[str, Declared]:
    """Every member's dtype and shape from its .npy header, and its uncompressed size (the
    zip's header) checked against them: the data is neither decompressed nor allocated."""
    found: dict[str, Declared] = {}
    readers = {(1, 0): np.lib.format.read_array_header_1_0,
               (2, 0): np.lib.format.read_array_header_2_0}
    for info in archive.infolist():
        if not info.filename.endswith(".npy"):
            raise InvalidField(f"member {info.filename!r} is not an array")
        key = info.filename[:-len(".npy")]
        if key in found:
            raise InvalidField(f"array {key!r} is stored twice")
        with archive.open(info) as member:
            counted = _Counting(member)
            version = np.lib.format.read_magic(counted)
            if version not in readers:
                raise InvalidField(f"array {key!r} has .npy format version {version}")
            shape, _, dtype = readers[version](counted)
        if dtype.hasobject:
            raise InvalidField(f"array {key!r} holds Python objects")
        shape = tuple(int(n) for n in shape)
        size = counted.count + math.prod(shape) * dtype.itemsize
        if info.file_size != size:
            extra = info.file_size - size
            raise InvalidField(f"array {key!r} holds {abs(extra)} bytes "
                               f"{'more' if extra > 0 else 'fewer'} than its header declares "
                               f"({dtype} {list(shape)})")
        found[key] = Declared(dtype, shape, info)
    return found


def _read(archive: zipfile.ZipFile, declared: Declared) -> np.ndarray:
    """The array itself (its size checked beforehand); reading it to the end checks its CRC."""
    with archive.open(declared.info) as member:
        return np.lib.format.read_array(member, allow_pickle=False)


# The metadata save() writes: the settings, the optimizer and scaler scalars, the weight
# names and the loss history, bounded by --history-rows (at most 65,536 rows of about 0.7 KB
# as stored: 4 bytes a character)
MAX_META_BYTES = 128 << 20


def _meta(archive: zipfile.ZipFile, headers: dict[str, Declared]) -> dict:
    declared = headers.get(META)
    if declared is None:
        raise InvalidField("the metadata is missing")
    if declared.dtype.kind != "U" or declared.shape != ():
        raise InvalidField(f"the metadata is {declared.dtype} {list(declared.shape)}, not text")
    if declared.dtype.itemsize > MAX_META_BYTES:   # before a byte of it is decompressed
        raise InvalidField(f"the metadata declares {declared.dtype.itemsize / (1 << 20):.0f} MiB "
                           f"of text, more than save() writes (at most "
                           f"{MAX_META_BYTES >> 20} MiB)")
    meta = json.loads(str(_read(archive, declared)))
    if not isinstance(meta, dict):
        raise InvalidField("the metadata is not an object")
    return meta


def _read_meta(target: str) -> dict:
    """The metadata of the checkpoint ``target`` (only that member is decompressed)."""
    try:
        with _open_archive(target) as archive:
            return _meta(archive, _headers(archive))
    except GraphoptError:
        raise
    except InvalidField as exc:
        raise GraphoptError(f"{target}: not a valid checkpoint ({exc})") from None
    except Exception as exc:  # noqa: BLE001 (any damage reads as "not readable")
        raise GraphoptError(f"{target}: not a readable checkpoint ({_why(exc)})") from None


def read_step(directory: str) -> int:
    """The step of the checkpoint in ``directory`` (reads only its metadata)."""
    target = path_in(directory)
    step = _read_meta(target).get("step")
    try:
        return _int(step, "step")
    except InvalidField as exc:
        raise GraphoptError(f"{target}: not a valid checkpoint ({exc})") from None


def read_settings(directory: str) -> dict:
    """The run options saved with the checkpoint in ``directory`` (reads only its metadata),
    each checked by type and range; {} when there is no checkpoint or it predates saved
    settings. One line naming the file and the field for a setting save() cannot have
    written; an unreadable file is refused as :func:`load` refuses it."""
    target = path_in(directory)
    if not os.path.lexists(target):
        return {}
    settings = _read_meta(target).get("settings")
    if settings is None:
        return {}
    try:
        return dict(check_settings(settings))
    except InvalidField as exc:
        raise GraphoptError(f"{target}: not a valid checkpoint ({exc})") from None


# -- a folder of its own for each run's Ctrl-C checkpoint ------------------------------------

RUN_ID_LENGTH = 12


def run_name(model: str | None) -> str:
    """The model file's stem (or the example's name), as a folder name can hold it."""
    stem = os.path.splitext(os.path.basename(model or ""))[0]
    safe = "".join(c if c.isalnum() or c in "._-" else "_" for c in stem).lstrip(".")
    return safe[:48] or "run"


def run_identity(graph: str | None, settings: dict, data: dict) -> str:
    """A short hex name of one run: its training graph's fingerprint, the options its
    checkpoints keep (all but the length, which a resumed run may change, and the model's
    name), and the data's seed, size and batch size."""
    kept = {k: v for k, v in (settings or {}).items() if k not in ("steps", "model")}
    record = [graph, kept, [data.get(k) for k in ("seed", "size", "batch_size")]]
    text = json.dumps(record, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()[:RUN_ID_LENGTH]


def _identity_in(directory: str) -> str | None:
    """The run id of the checkpoint in ``directory``; None when there is none; "" when it
    cannot be read (it may be another run's: never replaced)."""
    target = path_in(directory)
    if not os.path.lexists(target):
        return None
    try:
        meta = _read_meta(target)
        data = meta.get("data")
        return run_identity(meta.get("graph"), meta.get("settings") or {},
                            data if isinstance(data, dict) else {})
    except (GraphoptError, TypeError, ValueError):
        return ""


def claim_run_folder(base: str, name: str, identity: str) -> FolderLock:
    """The folder under ``base`` where a run without --checkpoint saves on Ctrl-C, locked:
    ``<name>-<identity>``, holding nothing or a checkpoint of this same run (a later Ctrl-C
    of the same run replaces its own). Where another run is using that folder or it holds a
    checkpoint of another run, ``<name>-<identity>-2``, ``-3``, ... instead."""
    stem = f"{name}-{identity}"
    for number in range(1, 101):
        folder = os.path.join(base, stem if number == 1 else f"{stem}-{number}")
        try:
            lock = FolderLock.acquire(folder, what=folder)
        except FolderInUse:
            continue
        if _identity_in(folder) in (None, identity):
            return lock
        lock.release()
    raise GraphoptError(f"no folder free for this run's checkpoint under {base} ({stem} to "
                        f"{stem}-100 are in use or hold other runs' checkpoints)")


# -- one run per checkpoint folder ------------------------------------------------------------
#
# Two runs saving into one folder would overwrite each other's checkpoints, the last writer
# winning in silence. A run that checkpoints holds an advisory lock on LOCK_NAME in the folder
# from start to end: flock(2) on the open file (the kernel drops it when the process dies,
# however it dies, so a lock left by a killed run is free again), and the file names the
# owner (pid, host, start time) for the refusal message. Where the file system has no flock
# (some network mounts), the pid and host in the file decide: a lock of a process that is
# gone from this host is taken over; one from another host is respected.

LOCK_NAME = ".graphopt-run.lock"


class FolderInUse(GraphoptError):
    """Another live run holds the folder's lock."""


class FolderLock:
    def __init__(self, directory: str, path: str, fd: int, created_folder: bool):
        self.directory, self.path, self.fd = directory, path, fd
        self.created_folder = created_folder

    @classmethod
    def acquire(cls, directory: str, what: str | None = None) -> FolderLock:
        """Lock ``directory`` for this run (``what``: the folder as the messages name it)."""
        what = what or f"--checkpoint {directory}"
        created = not os.path.isdir(directory)
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as exc:
            raise GraphoptError(f"{what}: cannot create the folder: "
                                f"{exc.strerror or exc}") from None
        refuse_special_file(path_in(directory), "checkpoint")   # never replaced or read
        path = os.path.join(directory, LOCK_NAME)
        flags = (os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
                 | getattr(os, "O_CLOEXEC", 0) | getattr(os, "O_NONBLOCK", 0))
        for _ in range(100):   # another run may unlink the file between our open and lock
            try:
                fd = os.open(path, flags, 0o666)
            except OSError as exc:
                raise GraphoptError(f"{what}: cannot create the lock file "
                                    f"{LOCK_NAME}: {exc.strerror or exc}") from None
            try:
                mode = os.fstat(fd).st_mode
                if not stat.S_ISREG(mode):
                    raise GraphoptError(f"{what}: the lock file {LOCK_NAME} is "
                                        f"{_kind(mode)}, not a regular file; remove it")
                locked = _flock(fd)
                owner = _read_owner(fd)
                if locked is False or (locked is None and _owner_alive(owner)):
                    raise FolderInUse(f"{what} is in use by another "
                                      f"graphopt run ({_describe_owner(owner)}); wait for it "
                                      "to end or use another folder")
                if os.fstat(fd).st_ino != os.stat(path, follow_symlinks=False).st_ino:
                    os.close(fd)   # the owner removed it as we opened it: lock the new one
                    continue
                try:
                    _write_owner(fd)
                except OSError as exc:   # a full disk: the lock names its file, nothing else
                    raise GraphoptError(f"{what}: cannot write the lock file {path}: "
                                        f"{exc.strerror or exc}") from None
            except BaseException:
                with contextlib.suppress(OSError):
                    os.close(fd)
                raise
            return cls(directory, path, fd, created)
        raise GraphoptError(f"{what}: the lock file {LOCK_NAME} keeps "
                            "changing; is another run starting and stopping there?")

    def release(self) -> None:
        """Remove the lock file (still ours: we hold its lock) and the folder if this run
        created it and left nothing in it."""
        with contextlib.suppress(OSError):
            if os.fstat(self.fd).st_ino == os.stat(self.path, follow_symlinks=False).st_ino:
                os.unlink(self.path)
        with contextlib.suppress(OSError):
            os.close(self.fd)
        if self.created_folder:
            with contextlib.suppress(OSError):
                os.rmdir(self.directory)   # only if empty


def _flock(fd: int) -> bool | None:
    """True: locked; False: another process holds it; None: no flock here."""
    try:
        import fcntl
    except ImportError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EACCES, errno.EAGAIN):
            return False
        return None   # ENOLCK, EOPNOTSUPP, EINVAL: a file system without flock
    return True


def _read_owner(fd: int) -> dict:
    try:
        data = os.pread(fd, 4096, 0)
        owner = json.loads(data.decode("utf-8")) if data else {}
    except (OSError, ValueError):
        return {}
    return owner if isinstance(owner, dict) else {}


def _write_owner(fd: int) -> None:
    owner = {"pid": os.getpid(), "host": socket.gethostname(),
             "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    data = json.dumps(owner).encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)


def _owner_alive(owner: dict) -> bool:
    pid, host = owner.get("pid"), owner.get("host")
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False   # nobody (an empty or damaged file): free
    if host != socket.gethostname():
        return True    # cannot tell from here: respect it
    return pid != os.getpid() and process_alive(pid)


def _describe_owner(owner: dict) -> str:
    if not owner.get("pid"):
        return "owner unknown"
    since = f", since {owner['started']}" if owner.get("started") else ""
    return f"pid {owner['pid']} on {owner.get('host', '?')}{since}"


def _fsync_directory(directory: str) -> None:
    with contextlib.suppress(OSError):  # not every file system lets a directory be opened
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _why(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    kind = type(exc).__name__
    return f"truncated or damaged: {kind}: {text}" if text else f"truncated or damaged: {kind}"


# What the run resuming a checkpoint checks of it (weight names and shapes, training graph,
# precision, data, optimizer slots), run by load() on the arrays as their headers declare them
# (:class:`Declared`), before any is decompressed: it raises GraphoptError for one that does
# not fit.
Check = Callable[["Checkpoint"], None]


def _state(meta: dict, params: dict, optimizer_arrays: dict, buffers: dict) -> Checkpoint:
    return Checkpoint(meta["step"], params, dict(meta["optimizer"]), optimizer_arrays,
                      dict(meta["scaler"]), dict(meta["data"]), list(meta["history"]),
                      meta["precision"], dict(meta.get("settings") or {}), meta.get("graph"),
                      buffers, meta.get("history_stride", 1), meta.get("first_loss"),
                      _nonfinite_counts(meta), meta.get("blas_threads"))


def _nonfinite_counts(meta: dict) -> dict[str, int]:
    """Skipped steps per kind (an older checkpoint's: counted in its step-by-step rows)."""
    if "nonfinite" in meta:
        return dict(meta["nonfinite"])
    counts: dict[str, int] = {}
    for row in meta["history"]:
        if row.get("nonfinite"):
            counts[row["nonfinite"]] = counts.get(row["nonfinite"], 0) + 1
    return counts


def load(directory: str, check: Check | None = None) -> Checkpoint:
    """The checkpoint in ``directory``; a truncated or damaged one is refused in one line.
    ``check`` sees the declared arrays first."""
    target = path_in(directory)
    if not os.path.lexists(target):
        raise GraphoptError(f"--resume: no checkpoint in {directory} ({FILENAME} is missing)")
    try:
        with _open_archive(target) as archive:
            headers = _headers(archive)
            meta = _meta(archive, headers)
            if type(meta.get("format")) is not int or meta.get("format") != FORMAT:
                raise GraphoptError(f"{target}: checkpoint format {meta.get('format')!r} is "
                                    f"not {FORMAT}")
            members = {k: v for k, v in headers.items() if k != META}
            params = {k[len("param/"):]: v for k, v in members.items()
                      if k.startswith("param/")}
            optimizer_arrays = {k[len("opt/"):]: v for k, v in members.items()
                                if k.startswith("opt/")}
            buffers = {k[len("buffer/"):]: v for k, v in members.items()
                       if k.startswith("buffer/")}
            unknown = sorted(set(members) - {f"param/{k}" for k in params}
                             - {f"opt/{k}" for k in optimizer_arrays}
                             - {f"buffer/{k}" for k in buffers})
            if unknown:
                raise InvalidField(f"unexpected arrays {unknown[:3]}")
            names = _names(meta, "params")
            if sorted(names) != sorted(params):
                raise InvalidField(f"weights {sorted(set(names) ^ set(params))[:3]} do not "
                                   "match the metadata")
            listed = _names(meta, "optimizer_arrays")
            if sorted(listed) != sorted(optimizer_arrays):
                raise InvalidField(f"optimizer arrays "
                                   f"{sorted(set(listed) ^ set(optimizer_arrays))[:3]}"
                                   " do not match the metadata")
            params = {n: params[n] for n in names}   # model order
            buffer_names = _names(meta, "buffers") if "buffers" in meta else []
            if sorted(buffer_names) != sorted(buffers):
                differing = sorted(set(buffer_names) ^ set(buffers))[:3]
                raise InvalidField(f"running statistics {differing} do not match the metadata")
            for name, value in buffers.items():
                if value.dtype != np.float32:
                    raise InvalidField(f"running statistic {name!r} is {value.dtype}, not "
                                       "float32")
            # everything about the arrays but their values, before reading any of them
            _validate(meta, params, optimizer_arrays)
            if check is not None:
                check(_state(meta, params, optimizer_arrays, buffers))
            # reading every member to its end checks every CRC: a damaged byte is refused
            params = {n: _read(archive, v) for n, v in params.items()}
            optimizer_arrays = {n: _read(archive, v) for n, v in optimizer_arrays.items()}
            buffers = {n: _read(archive, v) for n, v in buffers.items()}
        checkpoint = _state(meta, params, optimizer_arrays, buffers)
    except GraphoptError:
        raise
    except InvalidField as exc:
        raise GraphoptError(f"{target}: not a valid checkpoint ({exc})") from None
    except Exception as exc:  # noqa: BLE001 (zip, npy, JSON, missing keys: all "damaged")
        raise GraphoptError(f"{target}: not a readable checkpoint ({_why(exc)})") from None
    return checkpoint


# -- every field of the metadata and every array, checked before anything is used ----------
#
# A checkpoint is written only by save() above; one that says anything save() cannot have
# written (edited by hand or by a tool, or from a damaged disk whose zip CRCs still match) is
# refused in one line rather than resumed: a complex weight would lose its imaginary part, a
# negative skipped-step count or a history of the wrong length would make the resumed run's
# numbers wrong without a word. Unknown keys are ignored (a newer graphopt may add some).

PRECISIONS = ("fp32", "mixed", "fp16")
NONFINITE_KINDS = ("loss", "gradients")
MAX_SCALE = float(np.finfo(np.float32).max)
MAX_SEED = 2**32 - 1                  # as --seed (numpy's and CuPy's seed range)
INT64 = (-2**63, 2**63 - 1)


class InvalidField(ValueError):
    """A field of the checkpoint holds what save() never writes."""


def _names(meta: dict, key: str) -> list[str]:
    names = meta.get(key)
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names) \
            or len(set(names)) != len(names):
        raise InvalidField(f"{key} is not a list of distinct names")
    return names


def _int(value, what: str, low: int = 0, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < low \
            or (high is not None and value > high):
        bound = (str(low) if high == low else f"from {low} to {high}" if high is not None
                 else f">= {low}")
        raise InvalidField(f"{what} is {value!r}, not {'' if high == low else 'an integer '}"
                           f"{bound}")
    return value


def _number(value, what: str, *, low: float | None = None, positive: bool = False,
            finite: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidField(f"{what} is {value!r}, not a number")
    if finite and not math.isfinite(value):
        raise InvalidField(f"{what} is {value!r}, not a finite number")
    if (positive and not value > 0) or (low is not None and not value >= low):
        raise InvalidField(f"{what} is {value!r}, not {'> 0' if positive else f'>= {low}'}")
    return float(value)


def _text(value, what: str, *, optional: bool = False) -> str | None:
    if value is None and optional:
        return None
    if not isinstance(value, str):
        raise InvalidField(f"{what} is {value!r}, not {'text or null' if optional else 'text'}")
    return value


def _texts(value, what: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise InvalidField(f"{what} is {value!r}, not a list of names")
    return value


# The settings a run saves with its checkpoints (see runner._settings_record): how each is
# checked. A missing one is left to the command line (an older graphopt saved fewer).
SETTINGS: dict[str, Callable] = {
    "model": lambda v, w: _text(v, w),
    "loss": lambda v, w: _text(v, w, optional=True),
    "labels": lambda v, w: _text(v, w, optional=True),
    "optimizer": lambda v, w: _text(v, w),
    "lr": lambda v, w: _number(v, w, positive=True),
    "weight_decay": lambda v, w: None if v is None else _number(v, w, low=0),
    "precision": lambda v, w: _one_of(v, w, PRECISIONS),
    "loss_scale": lambda v, w: _text(v, w, optional=True),
    "batch_size": lambda v, w: _int(v, w, 1),
    "grad_accum": lambda v, w: _int(v, w, 1),
    "padding_idx": lambda v, w: None if v is None else _int(v, w, 0),
    "seed": lambda v, w: _int(v, w, 0, MAX_SEED),
    "freeze": _texts,
    "train": _texts,
    "steps": lambda v, w: _int(v, w, 1),
    "ignore_index": lambda v, w: _int(v, w, *INT64),
    "lr_schedule": lambda v, w: _text(v, w),
    "warmup": lambda v, w: _int(v, w, 0),
    "clip_grad_norm": lambda v, w: None if v is None else _number(v, w, positive=True),
    "class_axis": lambda v, w: None if v is None else _int(v, w, -64, 63),
    "untie": lambda v, w: _bool(v, w),
    "weight_decay_all": lambda v, w: _bool(v, w),
    "split_shared": lambda v, w: _bool(v, w),
}


def _bool(value, what: str) -> bool | None:
    if value is not None and not isinstance(value, bool):
        raise InvalidField(f"{what} is {value!r}, not true or false")
    return value


def _one_of(value, what: str, choices: tuple[str, ...]) -> str:
    if value not in choices or not isinstance(value, str):
        raise InvalidField(f"{what} is {value!r}, not one of {', '.join(choices)}")
    return value


def check_settings(settings) -> dict:
    """The saved run options, each checked by type and range (unknown keys are ignored: a
    newer graphopt may save more)."""
    if not isinstance(settings, dict):
        raise InvalidField(f"settings is {type(settings).__name__}, not an object")
    for key, check in SETTINGS.items():
        if key in settings:
            check(settings[key], f"settings {key}")
    return settings


def _dict(meta: dict, key: str) -> dict:
    value = meta.get(key)
    if not isinstance(value, dict):
        raise InvalidField(f"{key} is {type(value).__name__}, not an object")
    return value


OPTIONAL_RECORD_NUMBERS = {"lr": {"low": 0}, "grad_norm": {"low": 0, "finite": False},
                           "eval_loss": {"finite": False},
                           "perplexity": {"low": 0, "finite": False},
                           "eval_perplexity": {"low": 0, "finite": False},
                           "eval_accuracy": {"low": 0, "finite": False}}


def _validate_history(meta: dict, step: int, per_epoch: int) -> int:
    """The history's rows (see :mod:`.history`): row ``i`` ends at step
    ``min((i + 1) * stride, step)``, its counts add up; the skipped steps they record."""
    stride = _int(meta.get("history_stride", 1), "history_stride", 1)
    if stride & (stride - 1):
        raise InvalidField(f"history_stride is {stride}, not a power of 2")
    history = meta.get("history")
    rows = -(-step // stride)
    if not isinstance(history, list) or len(history) != rows \
            or (stride > 1 and (rows - 1) * stride >= step):
        count = len(history) if isinstance(history, list) else repr(history)
        raise InvalidField(f"the history holds {count} records for step {step} "
                           f"({stride} steps a record)")
    if meta.get("first_loss") is not None:
        _number(meta["first_loss"], "first_loss", finite=False)
    skipped = 0
    for index, record in enumerate(history):
        what = f"history record {index + 1}"
        if not isinstance(record, dict):
            raise InvalidField(f"{what} is {record!r}, not an object")
        end = min((index + 1) * stride, step)
        span = end - index * stride
        _int(record.get("step"), f"{what}: step", end, end)
        _int(record.get("steps", 1), f"{what}: steps", span, span)
        _int(record.get("epoch"), f"{what}: epoch", (end - 1) // per_epoch,
             (end - 1) // per_epoch)
        _number(record.get("loss"), f"{what}: loss", finite=False)
        _number(record.get("loss_scale"), f"{what}: loss_scale", positive=True)
        _number(record.get("seconds"), f"{what}: seconds", low=0)
        for key, bounds in OPTIONAL_RECORD_NUMBERS.items():   # written by some runs only
            if record.get(key) is not None:
                _number(record[key], f"{what}: {key}", **bounds)
        if not isinstance(record.get("applied"), bool):
            raise InvalidField(f"{what}: applied is {record.get('applied')!r}, not true/false")
        kind = record.get("nonfinite")
        if record["applied"] != (kind is None) or kind not in (None, *NONFINITE_KINDS):
            raise InvalidField(f"{what}: applied {record['applied']} with non-finite {kind!r}")
        low = skipped if record["applied"] else skipped + 1
        skipped = _int(record.get("skipped"), f"{what}: skipped", low,
                       skipped if record["applied"] else skipped + span)
    nonfinite = meta.get("nonfinite")
    if nonfinite is not None:
        if not isinstance(nonfinite, dict) or set(nonfinite) - set(NONFINITE_KINDS):
            raise InvalidField(f"nonfinite is {nonfinite!r}, not counts of "
                               f"{' and '.join(NONFINITE_KINDS)} steps")
        counted = sum(_int(n, f"nonfinite {kind}") for kind, n in nonfinite.items())
        if counted != skipped:
            raise InvalidField(f"nonfinite counts {counted} skipped steps, the history "
                               f"{skipped}")
    return skipped


def _validate(meta: dict, params: dict, optimizer_arrays: dict) -> None:
    """Every field of the metadata, and the dtype and shape of every array (``Declared``
    headers or the arrays themselves)."""
    step = _int(meta.get("step"), "step")
    precision = meta.get("precision")
    if precision not in PRECISIONS:
        raise InvalidField(f"precision is {precision!r}, not one of {', '.join(PRECISIONS)}")
    graph = meta.get("graph")
    if graph is not None and not (isinstance(graph, str) and len(graph) == 64
                                  and all(c in "0123456789abcdef" for c in graph)):
        raise InvalidField(f"graph is {graph!r}, not a SHA-256 fingerprint")
    if meta.get("settings") is not None:
        check_settings(meta["settings"])
    if meta.get("blas_threads") is not None:
        _int(meta["blas_threads"], "blas_threads", 1, 4096)
    master = np.dtype(np.float16 if precision == "fp16" else np.float32)
    for name, value in params.items():
        if value.dtype != master:   # complex, float64, integers: never written by save()
            raise InvalidField(f"weight {name!r} is {value.dtype}, not the {master} master "
                               f"weights of --precision {precision}")
    for key, value in optimizer_arrays.items():
        param, _, slot = key.rpartition("/")
        if param not in params or not slot:
            raise InvalidField(f"optimizer array {key!r} belongs to no weight")
        if value.dtype != np.float32 or value.shape != params[param].shape:
            raise InvalidField(f"optimizer array {key!r} is {value.dtype} {value.shape}, not "
                               f"float32 {params[param].shape} like its weight")
    data = _dict(meta, "data")
    size = _int(data.get("size"), "data size", 1)
    batch_size = _int(data.get("batch_size"), "data batch_size", 1, size)
    accumulate = _int(data.get("accumulate", 1), "data accumulate", 1, size // batch_size)
    _int(data.get("seed"), "data seed")
    per_epoch = size // (batch_size * accumulate)
    epoch, index = divmod(step, per_epoch)
    _int(data.get("epoch"), "data epoch", epoch, epoch)
    _int(data.get("batch_in_epoch"), "data batch_in_epoch", index, index)
    skipped = _validate_history(meta, step, per_epoch)
    applied = step - skipped
    optimizer = _dict(meta, "optimizer")
    optimizer_class = OPTIMIZERS.get(optimizer.get("name")) \
        if isinstance(optimizer.get("name"), str) else None
    if optimizer_class is None:
        raise InvalidField(f"optimizer name is {optimizer.get('name')!r}, not one of "
                           f"{', '.join(OPTIMIZERS)}")
    _int(optimizer.get("steps"), "optimizer steps", applied, applied)
    _number(optimizer.get("lr"), "optimizer lr", positive=True)
    problem = optimizer_class.scalars_problem(optimizer)   # each checks its own scalars
    if problem:
        raise InvalidField(problem)
    scaler = _dict(meta, "scaler")
    kind = scaler.get("kind")
    if kind not in ("static", "dynamic"):
        raise InvalidField(f"loss scaler kind is {kind!r}, not static or dynamic")
    _number(scaler.get("scale"), "loss scale", positive=True)
    if scaler["scale"] > MAX_SCALE:
        raise InvalidField(f"loss scale is {scaler['scale']!r}, beyond float32")
    _int(scaler.get("skipped"), "skipped-step count", skipped, skipped)
    if kind == "dynamic":
        interval = _int(scaler.get("interval"), "loss scale interval", 1)
        _int(scaler.get("good_steps"), "loss scaler good steps", 0, interval - 1)

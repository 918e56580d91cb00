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
removed by the next successful save on that host once their process is gone.

:func:`load` accepts only a complete checkpoint: a truncated or damaged file (the zip CRCs
cover every array) or inconsistent metadata is refused with one line naming the file.
"""
from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import socket
import tempfile
import time
from dataclasses import dataclass, field

import numpy as np

from graphopt.errors import GraphoptError
from graphopt.modelio import file_mode_for, process_alive

FILENAME = "checkpoint.npz"
FORMAT = 1
TEMP_PREFIX = ".checkpoint-"
TEMP_SUFFIX = ".npz.tmp"


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
    history: list[dict] = field(default_factory=list)
    precision: str = "fp32"
    settings: dict = field(default_factory=dict)   # the run's options, for a bare --resume
    graph: str | None = None          # fingerprint of the training graph (see .fingerprint)


def path_in(directory: str) -> str:
    return os.path.join(directory, FILENAME)


def _host_tag() -> str:
    return "".join(c if c.isalnum() else "_" for c in socket.gethostname())[:32] or "host"


def _write_archive(f, arrays: dict) -> None:
    """The bytes of the checkpoint (a plain .npz; the tests inject write faults here)."""
    np.savez(f, **arrays)


def save(directory: str, checkpoint: Checkpoint) -> str:
    meta = {"format": FORMAT, "step": checkpoint.step, "optimizer": checkpoint.optimizer,
            "scaler": checkpoint.scaler, "data": checkpoint.data,
            "history": checkpoint.history, "precision": checkpoint.precision,
            "settings": checkpoint.settings, "graph": checkpoint.graph,
            "params": list(checkpoint.params),
            "optimizer_arrays": list(checkpoint.optimizer_arrays)}
    arrays = {f"param/{k}": v for k, v in checkpoint.params.items()}
    arrays.update({f"opt/{k}": v for k, v in checkpoint.optimizer_arrays.items()})
    arrays["__meta__"] = np.array(json.dumps(meta))
    target = path_in(directory)
    tmp = None
    try:
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f"{TEMP_PREFIX}{_host_tag()}-{os.getpid()}-",
                                   suffix=TEMP_SUFFIX, dir=directory)
        os.fchmod(fd, file_mode_for(target))  # mkstemp's 0600 would ignore the umask
        with os.fdopen(fd, "wb") as f:
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
    _remove_stale_temporaries(directory)
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


def read_step(directory: str) -> int:
    """The step of the checkpoint in ``directory`` (reads only its metadata)."""
    target = path_in(directory)
    try:
        with np.load(target, allow_pickle=False) as archive:
            return int(json.loads(str(archive["__meta__"]))["step"])
    except Exception as exc:  # noqa: BLE001 (any damage reads as "not readable")
        raise GraphoptError(f"{target}: not a readable checkpoint ({_why(exc)})") from None


def read_settings(directory: str) -> dict:
    """The run options saved with the checkpoint in ``directory`` (reads only its metadata);
    {} when there is no checkpoint or it predates saved settings (``load`` says what is
    wrong with a damaged one)."""
    try:
        with np.load(path_in(directory), allow_pickle=False) as archive:
            settings = json.loads(str(archive["__meta__"])).get("settings")
    except Exception:  # noqa: BLE001 (missing or damaged: load() reports it in one line)
        return {}
    return dict(settings) if isinstance(settings, dict) else {}


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


class FolderLock:
    def __init__(self, directory: str, path: str, fd: int, created_folder: bool):
        self.directory, self.path, self.fd = directory, path, fd
        self.created_folder = created_folder

    @classmethod
    def acquire(cls, directory: str) -> FolderLock:
        created = not os.path.isdir(directory)
        try:
            os.makedirs(directory, exist_ok=True)
        except OSError as exc:
            raise GraphoptError(f"--checkpoint {directory}: cannot create the folder: "
                                f"{exc.strerror or exc}") from None
        path = os.path.join(directory, LOCK_NAME)
        for _ in range(100):   # another run may unlink the file between our open and lock
            try:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0)
                             | getattr(os, "O_CLOEXEC", 0), 0o666)
            except OSError as exc:
                raise GraphoptError(f"--checkpoint {directory}: cannot create the lock file "
                                    f"{LOCK_NAME}: {exc.strerror or exc}") from None
            try:
                locked = _flock(fd)
                owner = _read_owner(fd)
                if locked is False or (locked is None and _owner_alive(owner)):
                    raise GraphoptError(f"--checkpoint {directory} is in use by another "
                                        f"graphopt run ({_describe_owner(owner)}); wait for it "
                                        "to end or use another folder")
                if os.fstat(fd).st_ino != os.stat(path, follow_symlinks=False).st_ino:
                    os.close(fd)   # the owner removed it as we opened it: lock the new one
                    continue
                _write_owner(fd)
            except BaseException:
                with contextlib.suppress(OSError):
                    os.close(fd)
                raise
            return cls(directory, path, fd, created)
        raise GraphoptError(f"--checkpoint {directory}: the lock file {LOCK_NAME} keeps "
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


def _remove_stale_temporaries(directory: str) -> None:
    """Temporary files of writers on this host that died before they could clean up."""
    mine = f"{TEMP_PREFIX}{_host_tag()}-"
    with contextlib.suppress(OSError):
        for name in os.listdir(directory):
            if not (name.startswith(mine) and name.endswith(TEMP_SUFFIX)):
                continue
            pid = name[len(mine):].split("-", 1)[0]
            if pid.isdigit() and int(pid) != os.getpid() and not process_alive(int(pid)):
                with contextlib.suppress(OSError):
                    os.unlink(os.path.join(directory, name))


    return True


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


def load(directory: str) -> Checkpoint:
    """The checkpoint in ``directory``; a truncated or damaged one is refused in one line."""
    target = path_in(directory)
    if not os.path.isfile(target):
        raise GraphoptError(f"--resume: no checkpoint in {directory} ({FILENAME} is missing)")
    try:
        with np.load(target, allow_pickle=False) as archive:
            meta = json.loads(str(archive["__meta__"]))
            if not isinstance(meta, dict):
                raise ValueError("the metadata is not an object")
            # reading every member checks every CRC: a damaged byte anywhere is refused here
            members = {k: archive[k] for k in archive.files if k != "__meta__"}
        if type(meta.get("format")) is not int or meta.get("format") != FORMAT:
            raise GraphoptError(f"{target}: checkpoint format {meta.get('format')!r} is not "
                                f"{FORMAT}")
        params = {k[len("param/"):]: v for k, v in members.items() if k.startswith("param/")}
        optimizer_arrays = {k[len("opt/"):]: v for k, v in members.items()
                            if k.startswith("opt/")}
        unknown = sorted(set(members) - {f"param/{k}" for k in params}
                         - {f"opt/{k}" for k in optimizer_arrays})
        if unknown:
            raise ValueError(f"unexpected arrays {unknown[:3]}")
        names = _names(meta, "params")
        if sorted(names) != sorted(params):
            raise ValueError(f"weights {sorted(set(names) ^ set(params))[:3]} do not match the "
                             "metadata")
        listed = _names(meta, "optimizer_arrays")
        if sorted(listed) != sorted(optimizer_arrays):
            raise ValueError(f"optimizer arrays "
                             f"{sorted(set(listed) ^ set(optimizer_arrays))[:3]}"
                             " do not match the metadata")
        params = {n: params[n] for n in names}   # model order
        _validate(meta, params, optimizer_arrays)
        checkpoint = Checkpoint(meta["step"], params, dict(meta["optimizer"]), optimizer_arrays,
                                dict(meta["scaler"]), dict(meta["data"]), list(meta["history"]),
                                meta["precision"], dict(meta.get("settings") or {}),
                                meta.get("graph"))
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


def _dict(meta: dict, key: str) -> dict:
    value = meta.get(key)
    if not isinstance(value, dict):
        raise InvalidField(f"{key} is {type(value).__name__}, not an object")
    return value


def _validate(meta: dict, params: dict[str, np.ndarray],
              optimizer_arrays: dict[str, np.ndarray]) -> None:
    step = _int(meta.get("step"), "step")
    precision = meta.get("precision")
    if precision not in PRECISIONS:
        raise InvalidField(f"precision is {precision!r}, not one of {', '.join(PRECISIONS)}")
    graph = meta.get("graph")
    if graph is not None and not (isinstance(graph, str) and len(graph) == 64
                                  and all(c in "0123456789abcdef" for c in graph)):
        raise InvalidField(f"graph is {graph!r}, not a SHA-256 fingerprint")
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
    _int(data.get("seed"), "data seed")
    per_epoch = size // batch_size
    epoch, index = divmod(step, per_epoch)
    _int(data.get("epoch"), "data epoch", epoch, epoch)
    _int(data.get("batch_in_epoch"), "data batch_in_epoch", index, index)
    history = meta.get("history")
    if not isinstance(history, list) or len(history) != step:
        count = len(history) if isinstance(history, list) else repr(history)
        raise InvalidField(f"the history holds {count} records for step {step}")
    applied = skipped = 0
    for index, record in enumerate(history):
        what = f"history record {index + 1}"
        if not isinstance(record, dict):
            raise InvalidField(f"{what} is {record!r}, not an object")
        _int(record.get("step"), f"{what}: step", index + 1, index + 1)
        _int(record.get("epoch"), f"{what}: epoch", index // per_epoch, index // per_epoch)
        _number(record.get("loss"), f"{what}: loss", finite=False)
        _number(record.get("loss_scale"), f"{what}: loss_scale", positive=True)
        _number(record.get("seconds"), f"{what}: seconds", low=0)
        if not isinstance(record.get("applied"), bool):
            raise InvalidField(f"{what}: applied is {record.get('applied')!r}, not true/false")
        kind = record.get("nonfinite")
        if record["applied"] != (kind is None) or kind not in (None, *NONFINITE_KINDS):
            raise InvalidField(f"{what}: applied {record['applied']} with non-finite {kind!r}")
        applied += record["applied"]
        skipped += not record["applied"]
        _int(record.get("skipped"), f"{what}: skipped", skipped, skipped)
    optimizer = _dict(meta, "optimizer")
    if not isinstance(optimizer.get("name"), str):
        raise InvalidField(f"optimizer name is {optimizer.get('name')!r}")
    _int(optimizer.get("steps"), "optimizer steps", applied, applied)
    _number(optimizer.get("lr"), "optimizer lr", positive=True)
    for key, value in optimizer.items():
        if key not in ("name", "steps"):
            _number(value, f"optimizer {key}", low=0)
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

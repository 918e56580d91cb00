"""Loading and saving models: clear errors for bad files, atomic writes, external data.

Weights are never read into memory on load: external data stays in its files, and a model
file's large inline weights stay in the model file, referenced where they lie
(:mod:`graphopt.weight_refs`). On save both are streamed, in chunks: external data into one
data file beside the output, inline weights back into the output model.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import math
import os
import re
import shutil
import socket
import stat
import sys
import tempfile
import time
import weakref

import numpy as np
import onnx
from google.protobuf.message import DecodeError
from onnx import numpy_helper

from . import weight_refs
from .checks import check_structure
from .errors import GraphoptError
from .ir import Model
from .ir import external_tensors as _external_tensors
from .vocabulary import STANDARD_DOMAIN, normalize_domain, subgraphs_of

EXTERNAL_COPY_CHUNK = 64 << 20
DIGEST_CHARS = 12


def load(source, *, check: bool = True) -> Model:
    """Load a model from a path or a ModelProto; any problem is a one-line GraphoptError.

    A model file and each of its external data files must be regular files; every external
    data file is opened once, here, checked through the open descriptor, and kept open: the
    weights are later read (saved, folded, trained) from that descriptor, never by name. A
    model file whose large weights are inline is kept open the same way, its weights left
    where they are (:mod:`graphopt.weight_refs`)."""
    opened = None
    if isinstance(source, onnx.ModelProto):
        proto = onnx.ModelProto()
        proto.CopyFrom(source)
        path = None
    else:
        path = os.fspath(source)
        proto, opened = _read_proto(path)
    try:
        _check_looks_like_onnx(proto, path)
        _refuse_undecodable_names(proto, path)
        model = Model(proto, path)
        if opened is not None:  # the model file holds its own weights
            model.external = ExternalFiles(path, own_file=opened)
            opened = None
        if check:
            model.external = _check_external_data(proto, path, model.external)
            _check_inline_sizes(proto, path)
            try:
                check_structure(proto, model.base_dir)
            except onnx.checker.ValidationError as exc:
                raise GraphoptError(f"{path or 'model'}: invalid ONNX model: "
                                    f"{_first_line(exc)}") from None
    finally:
        if opened is not None:
            os.close(opened[0])
    return model


def _check_inline_sizes(proto: onnx.ModelProto, path: str | None) -> None:
    """Each large inline tensor holds what its dims and type need, in ``raw_data`` or its
    typed field (``float_data``, ...). (The ONNX checker checks this too, but
    :func:`check_structure` shows it no large weight.)"""
    for tensor in proto.graph.initializer:
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            continue
        if not tensor.HasField("raw_data"):
            _check_typed_values(tensor, path)
            continue
        expected = _byte_size(tensor)
        if expected is not None and expected >= weight_refs.MIN_REFERENCED_BYTES:
            held = len(tensor.raw_data)
            if held != expected:
                raise GraphoptError(f"{path or 'model'}: invalid ONNX model: tensor "
                                    f"'{tensor.name}' holds {held} bytes of raw data; its dims "
                                    f"and type need {expected}")


def _check_typed_values(tensor: onnx.TensorProto, path: str | None) -> None:
    """A large tensor without raw_data holds one value per element in its typed field (a
    tensor of [100000, 4] with no data at all passed the structure check, which sees no
    large weight, and was written out broken)."""
    expected = _byte_size(tensor)
    if expected is None or expected < weight_refs.MIN_REFERENCED_BYTES:
        return   # small: the ONNX checker sees it
    try:
        field = onnx.helper.tensor_dtype_to_field(tensor.data_type)
    except (KeyError, ValueError):
        return
    elements = math.prod(tensor.dims)
    held = len(getattr(tensor, field))
    if tensor.data_type in (onnx.TensorProto.COMPLEX64, onnx.TensorProto.COMPLEX128):
        held //= 2
    if held != elements:
        raise GraphoptError(f"{path or 'model'}: invalid ONNX model: tensor '{tensor.name}' "
                            f"holds {held} values; its dims {list(tensor.dims)} need "
                            f"{elements}")


# A serialized ModelProto cannot be larger (protobuf's limit): bigger weights are external.
MAX_MODEL_BYTES = (2 << 30) - 1


def _read_proto(path: str) -> tuple[onnx.ModelProto, tuple[int, os.stat_result] | None]:
    """The model in the file, and the file, still open, when the model references its large
    weights in it (None when it holds them all)."""
    if not os.path.exists(path):
        raise GraphoptError(f"{path}: no such file")
    if os.path.isdir(path):
        raise GraphoptError(f"{path}: is a directory, not an ONNX file")
    fd, st = open_regular(path, "model")
    keep_open = False
    try:
        if st.st_size == 0:
            raise GraphoptError(f"{path}: empty file, not an ONNX model")
        if st.st_size > MAX_MODEL_BYTES:
            raise GraphoptError(f"{path}: {st.st_size} bytes is more than an ONNX protobuf "
                                "can hold (2 GiB); store the weights as external data")
        try:
            proto = weight_refs.read_without_weights(fd, st.st_size, os.path.basename(path))
        except (DecodeError, RuntimeError, ValueError):
            proto = None  # parsed as a whole below, which says what is wrong
        if proto is not None:
            keep_open = True
            return proto, (fd, st)
        data = _pread_exactly(fd, st.st_size, 0, path)
    except OSError as exc:
        raise GraphoptError(f"{path}: cannot read: {exc.strerror}") from None
    finally:
        if not keep_open:
            os.close(fd)
    proto = onnx.ModelProto()
    try:
        proto.ParseFromString(data)
    except (DecodeError, RuntimeError, ValueError):
        raise GraphoptError(f"{path}: not an ONNX model (protobuf parse failed; truncated?)") \
            from None
    return proto, None


_KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"),
          (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
          (stat.S_ISSOCK, "a socket"))


def _kind(mode: int) -> str:
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def open_regular(path: str, what: str, *, follow: bool = True) -> tuple[int, os.stat_result]:
    """Open ``path`` for reading without blocking (a FIFO with no writer would block forever)
    and without following a final symlink unless ``follow``; only a regular file is accepted,
    judged on the open descriptor (fstat), and its size comes from there too."""
    flags = (os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0)
             | getattr(os, "O_CLOEXEC", 0) | (0 if follow else getattr(os, "O_NOFOLLOW", 0)))
    try:
        fd = os.open(path, flags)
    except ValueError:  # a NUL byte in the name
        raise GraphoptError(f"{path!r}: not a valid file name") from None
    except OSError as exc:
        raise GraphoptError(f"{path}: cannot open the {what}: {exc.strerror}") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise GraphoptError(f"{path}: the {what} is {_kind(st.st_mode)}, not a regular file")
    return fd, st


def _pread_exactly(fd: int, length: int, offset: int, where: str) -> bytes:
    parts, remaining = [], length
    while remaining:
        chunk = os.pread(fd, min(EXTERNAL_COPY_CHUNK, remaining), offset)
        if not chunk:
            raise GraphoptError(f"{where}: the file ended early (changed while it was read?)")
        parts.append(chunk)
        offset += len(chunk)
        remaining -= len(chunk)
    return b"".join(parts)


def _check_looks_like_onnx(proto: onnx.ModelProto, path: str | None) -> None:
    where = path or "model"
    if proto.ir_version <= 0 or not proto.HasField("graph"):
        raise GraphoptError(f"{where}: not an ONNX model (no ir_version or graph)")
    if not proto.opset_import:
        raise GraphoptError(f"{where}: not an ONNX model (no opset_import)")
    newest = onnx.defs.onnx_opset_version()
    for opset in proto.opset_import:
        if normalize_domain(opset.domain) == STANDARD_DOMAIN and not 1 <= opset.version <= newest:
            raise GraphoptError(f"{where}: unsupported opset {opset.version} (this onnx "
                                f"supports 1 to {newest})")


def _graph_names(graph: onnx.GraphProto):
    """(what, name) of every name a graph and its subgraphs hold."""
    for kind, infos in (("graph input", graph.input), ("graph output", graph.output),
                        ("value_info", graph.value_info)):
        for info in infos:
            yield kind, info.name
    for tensor in graph.initializer:
        yield "initializer", tensor.name
    for node in graph.node:
        yield "node name", node.name
        for name in (*node.input, *node.output):
            yield "tensor name of a node", name
        for sub in subgraphs_of(node):
            yield from _graph_names(sub)


def _refuse_undecodable_names(proto: onnx.ModelProto, path: str | None) -> None:
    """Protobuf hands a string field that is not valid UTF-8 back as bytes: every name is
    text to graphopt (and to ONNX's checker), so such a model is refused in one line."""
    for function in proto.functions:
        names = [("function", function.name), *(("function input", n) for n in function.input),
                 *(("function output", n) for n in function.output)]
        for node in function.node:
            names += [("tensor name of a function node", n) for n in (*node.input,
                                                                      *node.output)]
        for kind, name in names:
            if isinstance(name, bytes):
                raise GraphoptError(f"{path or 'model'}: a {kind} is not valid UTF-8 text "
                                    f"({name!r})")
    for kind, name in _graph_names(proto.graph):
        if isinstance(name, bytes):
            raise GraphoptError(f"{path or 'model'}: a {kind} is not valid UTF-8 text "
                                f"({name!r})")


def _first_line(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return " ".join(text[0].split()) if text else type(exc).__name__


def _uses_external_data(proto: onnx.ModelProto) -> bool:
    return bool(_external_tensors(proto))


def _external_info(tensor: onnx.TensorProto) -> dict[str, str]:
    return {e.key: e.value for e in tensor.external_data}


def _check_external_data(proto: onnx.ModelProto, path: str | None,
                         files: ExternalFiles | None = None) -> ExternalFiles | None:
    """External data must stay inside the model's folder, be regular files and hold every
    tensor's bytes: no path tricks. Returns the files, open, for reading later (``files``:
    those already open, the model file's own among them)."""
    tensors = _external_tensors(proto)
    if not tensors:
        return files
    if path is None:
        raise GraphoptError("model has external data but was given without a path to find it")
    files = files or ExternalFiles(path)
    try:
        for tensor in tensors:
            files.check(tensor)
    except BaseException:
        files.close()
        raise
    return files


class ExternalFiles:
    """The external data files of one model, each opened once and checked on its descriptor.

    A location is refused if it is empty, absolute or leads outside the model's folder (after
    resolving symlinks and ``..``). The file is then opened without following a final
    symlink and the open descriptor itself is checked: a regular file whose real path (from
    the kernel, /proc/self/fd) is inside the folder. Everything read later comes from that
    descriptor, so a file swapped for a symlink after the check is never read.

    ``own_file``: the model file itself, open, when its weights are referenced in it
    (:mod:`graphopt.weight_refs`); their location is the file's own name, and they are
    written back inline (:attr:`own_location`)."""

    def __init__(self, model_path: str,
                 own_file: tuple[int, os.stat_result] | None = None):
        self.model_path = model_path
        self.base = os.path.realpath(os.path.dirname(os.path.abspath(model_path)))
        self.opened: dict[str, tuple[int, os.stat_result]] = {}  # location -> (fd, fstat)
        self.own_location = None
        if own_file is not None:
            self.own_location = os.path.basename(model_path)
            self.opened[self.own_location] = own_file
        self._finalizer = weakref.finalize(self, _close_all, self.opened)

    def is_own(self, tensor: onnx.TensorProto) -> bool:
        """A weight referenced in the model file itself, not in an external data file."""
        return (self.own_location is not None
                and _external_info(tensor).get("location") == self.own_location)

    def close(self) -> None:
        self._finalizer()

    def stats(self) -> list[tuple[str, os.stat_result]]:
        """(location, stat) of each external data file (the model file itself is not one)."""
        return [(location, st) for location, (_, st) in self.opened.items()
                if location != self.own_location]

    def _refuse(self, tensor, why: str) -> GraphoptError:
        return GraphoptError(f"{self.model_path}: tensor '{tensor.name}' {why}")

    def _open(self, tensor: onnx.TensorProto) -> tuple[int, os.stat_result]:
        location = _external_info(tensor).get("location", "")
        if location in self.opened:
            return self.opened[location]
        if "\0" in location:
            raise self._refuse(tensor, f"has an invalid external data location {location!r}")
        target = os.path.realpath(os.path.join(self.base, location))
        if not location or os.path.isabs(location) or not _inside(target, self.base):
            raise self._refuse(tensor, "has external data outside the model's folder "
                                       f"({location!r})")
        if not os.path.lexists(target):
            raise self._refuse(tensor, f"external data file {location!r} is missing")
        fd, st = open_regular(target, f"external data file of tensor '{tensor.name}'",
                              follow=False)
        if st.st_nlink > 1:  # as ONNX's checker: another name could be written meanwhile
            os.close(fd)
            raise self._refuse(tensor, f"has external data in {location!r}, a file with more "
                                       "than one name (hard link): refused, as ONNX refuses it")
        real = _fd_path(fd)
        if (real is not None and not _inside(real, self.base)) or (
                real is None and _identity(os.stat(target)) != _identity(st)):
            os.close(fd)  # swapped between the check and the open
            raise self._refuse(tensor, "has external data outside the model's folder "
                                       f"({location!r})")
        _ensure_fd_room(len(self.opened) + 1)
        self.opened[location] = (fd, st)
        return fd, st

    def check(self, tensor: onnx.TensorProto) -> tuple[int, int, int]:
        """(fd, offset, length) of a tensor's bytes, checked against the file's size."""
        location = _external_info(tensor).get("location", "")
        fd, st = self._open(tensor)
        offset, length = _external_extent(tensor, self.model_path)
        if length is None:
            length = max(st.st_size - offset, 0)
        if offset + length > st.st_size:
            raise self._refuse(tensor, f"external data runs past the end of {location!r}")
        expected = _byte_size(tensor)
        if expected is not None and expected != length:
            if self.is_own(tensor):
                raise self._refuse(tensor, f"holds {length} bytes of raw data; its dims and "
                                           f"type need {expected}")
            raise self._refuse(tensor, f"declares {expected} bytes of external data but "
                                       f"{location!r} holds {length} for it")
        return fd, offset, length

    def read(self, tensor: onnx.TensorProto) -> bytes:
        fd, offset, length = self.check(tensor)
        return _pread_exactly(fd, length, offset, self.model_path)

    def array(self, tensor: onnx.TensorProto) -> np.ndarray:
        """The tensor's value, a new writable array. Plain numeric types are read straight
        into the array's memory (one copy, from the file); others go through onnx."""
        dtype = _PLAIN_DTYPES.get(tensor.data_type)
        if dtype is not None and sys.byteorder == "little":
            fd, offset, length = self.check(tensor)
            buffer = bytearray(length)
            view, done = memoryview(buffer), 0
            while done < length:
                count = os.preadv(fd, [view[done:]], offset + done)
                if count == 0:
                    raise GraphoptError(f"{self.model_path}: the file ended early (changed "
                                        "while it was read?)")
                done += count
            return np.frombuffer(buffer, dtype).reshape([int(d) for d in tensor.dims])
        inline = onnx.TensorProto()
        inline.CopyFrom(tensor)
        inline.raw_data = self.read(tensor)
        inline.ClearField("data_location")
        del inline.external_data[:]
        return numpy_helper.to_array(inline)

    def copy(self, tensor: onnx.TensorProto, dst, digest=None) -> int:
        """Append a tensor's bytes to the binary file object ``dst``; returns the length.
        With a ``digest`` they are read chunk by chunk and hashed on the way; without one the
        kernel copies them (copy_file_range: no pass through this process, and a shared
        copy-on-write extent on filesystems that have them)."""
        fd, offset, length = self.check(tensor)
        if digest is None and _kernel_copy(fd, offset, length, dst):
            return length
        remaining = length
        while remaining:
            chunk = os.pread(fd, min(EXTERNAL_COPY_CHUNK, remaining), offset)
            if not chunk:
                raise GraphoptError(f"external data for '{tensor.name}' ends early")
            dst.write(chunk)
            if digest is not None:
                digest.update(chunk)
            offset += len(chunk)
            remaining -= len(chunk)
        return length

    def fingerprint(self, tensors) -> bytes:
        """What identifies the bytes of ``tensors`` without reading them: each file's
        identity, size and modification and change times (now, from the open descriptor),
        and each tensor's extent in it; b"" when a file changed too recently for its times to
        tell (its times may not move again for a write within their granularity: then only
        the content can name it)."""
        now = time.time_ns()
        parts = []
        for location, (fd, _) in sorted(self.opened.items()):
            st = os.fstat(fd)
            if now - max(st.st_mtime_ns, st.st_ctime_ns) < RECENT_CHANGE_NS:
                return b""
            parts.append(f"{location}\0{st.st_dev}:{st.st_ino}:{st.st_size}:"
                         f"{st.st_mtime_ns}:{st.st_ctime_ns}")
        for tensor in tensors:
            _, offset, length = self.check(tensor)
            parts.append(f"{_external_info(tensor).get('location', '')}\0{offset}:{length}")
        return "\n".join(parts).encode("utf-8", "surrogateescape")


# A file modified within this long is named by its content (the racy-timestamp rule git uses).
RECENT_CHANGE_NS = 2_000_000_000


def _kernel_copy(src: int, offset: int, length: int, dst) -> bool:
    """Copy ``length`` bytes at ``offset`` of ``src`` to the end of ``dst`` with
    copy_file_range; False (nothing written) where the kernel or filesystem has none."""
    copy_range = getattr(os, "copy_file_range", None)
    if copy_range is None or length == 0:
        return length == 0
    dst.flush()
    out = dst.fileno()
    start = position = os.lseek(out, 0, os.SEEK_END)
    try:
        while position - start < length:
            copied = copy_range(src, out, length - (position - start), offset + position - start,
                                position)
            if copied == 0:
                raise GraphoptError("external data ends early (changed while it was copied?)")
            position += copied
    except OSError as exc:
        if position != start or exc.errno not in _NO_KERNEL_COPY:
            raise
        return False
    dst.seek(position)
    return True


_NO_KERNEL_COPY = {getattr(errno, name) for name in ("ENOSYS", "EXDEV", "EINVAL", "EOPNOTSUPP",
                                                      "ENOTSUP", "EBADF", "EPERM")
                   if hasattr(errno, name)}


# ONNX element types whose raw bytes are the little-endian numpy array as it is
_PLAIN_DTYPES = {getattr(onnx.TensorProto, name): np.dtype(dtype) for name, dtype in (
    ("FLOAT", "<f4"), ("FLOAT16", "<f2"), ("DOUBLE", "<f8"), ("INT8", "i1"), ("UINT8", "u1"),
    ("INT16", "<i2"), ("UINT16", "<u2"), ("INT32", "<i4"), ("UINT32", "<u4"),
    ("INT64", "<i8"), ("UINT64", "<u8"), ("BOOL", "?"))}


def _close_all(opened: dict) -> None:
    for fd, _ in opened.values():
        with contextlib.suppress(OSError):
            os.close(fd)
    opened.clear()


def _inside(path: str, folder: str) -> bool:
    return os.path.commonpath([folder, path]) == folder


def _identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def _fd_path(fd: int) -> str | None:
    """The real path of an open file, from the kernel (None where /proc is not there)."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return None


def _ensure_fd_room(count: int) -> None:
    """Models stored one file per tensor keep many files open: raise the soft limit."""
    try:
        import resource
    except ImportError:
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or count + 64 < soft:
        return
    wanted = hard if hard == resource.RLIM_INFINITY else min(hard, max(2 * soft, count + 256))
    with contextlib.suppress(ValueError, OSError):
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))
    if count + 16 >= resource.getrlimit(resource.RLIMIT_NOFILE)[0]:
        raise GraphoptError(f"the model has more external data files ({count}+) than this "
                            "process may keep open (ulimit -n)")


def external_files(model: Model) -> ExternalFiles:
    """The model's checked, open data files (opened and checked now for a Model built
    from a proto and a path rather than by :func:`load`)."""
    if model.external is None:
        if not model.path:
            raise GraphoptError("model has external data but was given without a path to "
                                "find it")
        model.external = ExternalFiles(model.path)
    return model.external


def external_bytes(model: Model) -> int:
    """Bytes of the model's external data, from the checked extents (nothing is read)."""
    files = external_files(model)
    return sum(files.check(tensor)[2] for tensor in _external_tensors(model.proto))


def tensor_value(tensor: onnx.TensorProto, external: ExternalFiles | None = None) -> np.ndarray:
    """A tensor's value: from the open file its reference points into, or from the proto."""
    if tensor.data_location == onnx.TensorProto.EXTERNAL and external is not None:
        return external.array(tensor)
    return onnx.numpy_helper.to_array(tensor)


def load_external_data(model: Model) -> None:
    """Read every external tensor into the proto (from the checked descriptors)."""
    files = external_files(model)
    for tensor in _external_tensors(model.proto):
        tensor.raw_data = files.read(tensor)
        tensor.ClearField("data_location")
        del tensor.external_data[:]


def _external_extent(tensor: onnx.TensorProto, path: str) -> tuple[int, int | None]:
    info = _external_info(tensor)
    try:
        offset = int(info.get("offset", 0))
        length = int(info["length"]) if "length" in info else None
    except ValueError:
        raise GraphoptError(f"{path}: tensor '{tensor.name}' has a non-numeric external data "
                            "offset or length") from None
    if offset < 0 or (length is not None and length < 0):
        raise GraphoptError(f"{path}: tensor '{tensor.name}' has a negative external data "
                            "offset or length")
    return offset, length


def _byte_size(tensor: onnx.TensorProto) -> int | None:
    """Bytes the tensor's dims and type need, or None for types without a fixed size."""
    try:
        itemsize = onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
    except (KeyError, TypeError, ValueError):
        return None
    if tensor.data_type == onnx.TensorProto.STRING:
        return None
    count = 1
    for dim in tensor.dims:
        count *= dim
    return count * itemsize


def check_output_path(out: str, source=None, in_place: bool = False, *,
                      what: str = "output", protect: ProtectedFiles | None = None) -> None:
    """Refuse before doing any work: a missing folder, a path that is not a regular file (a
    FIFO, a device: only regular files are replaced), or a path that would overwrite one of
    the input's files. ``source``: the input model (a loaded :class:`Model`, whose external
    data files are protected too, or a path); ``protect``: every other file the command
    reads."""
    folder = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(folder):
        problem = "is a file, not a folder" if os.path.exists(folder) else "does not exist"
        raise GraphoptError(f"{out}: output folder {folder} {problem}")
    if not os.access(folder, os.W_OK):
        raise GraphoptError(f"{out}: output folder {folder} is not writable")
    if os.path.isdir(out):
        raise GraphoptError(f"{out}: is a directory")
    refuse_special_file(out, what)
    refuse_input_files(out, source, in_place, what=what)
    if protect is not None:
        protect.refuse(out, what)


def refuse_special_file(out: str, what: str = "output") -> None:
    """Only a regular file (or nothing) is replaced: writing a FIFO blocks until a reader
    comes, a device is not ours to replace. A symlink to a regular file is fine: the link
    itself is replaced, never the file it points to."""
    try:
        st = os.lstat(out)
    except (OSError, ValueError):
        return
    through = ""
    if stat.S_ISLNK(st.st_mode):
        try:
            st = os.stat(out)
        except OSError:
            return   # a dangling symlink: the rename replaces the link
        through = " (through a symlink)"
    if not stat.S_ISREG(st.st_mode):
        raise GraphoptError(f"{out}: the {what} is {_kind(st.st_mode)}{through}, not a "
                            "regular file; graphopt replaces only regular files")


class ProtectedFiles:
    """Every file a command reads (the model, its external data, training data, a resumed
    checkpoint) and every file it has already written, by identity (device, inode): an
    output is checked against them when the command starts and again just before it is
    published, so no spelling (symlink, ``..``, hard link) lets one output replace an input
    or an earlier output of the same command."""

    def __init__(self) -> None:
        self._files: dict[tuple[int, int], tuple[str, str]] = {}   # identity -> (what, path)

    def add(self, path: str | None, what: str) -> None:
        if not path:
            return
        with contextlib.suppress(OSError, ValueError):
            self._files.setdefault(_identity(os.stat(path)), (what, os.fspath(path)))

    def add_model(self, model, what: str = "input model") -> None:
        """A model and each external data file it references (a loaded :class:`Model`)."""
        for name, st, is_model in input_files(model):
            self._files.setdefault(_identity(st), (what if is_model else
                                                   f"{what}'s external data", name))

    def refuse(self, out: str, what: str = "output", *, allow: tuple[str, ...] = ()) -> None:
        """``allow``: paths this output may replace (the checkpoint a run resumed from is
        replaced by that run's next checkpoint)."""
        try:
            st = os.stat(out)
        except (OSError, ValueError):
            return
        found = self._files.get(_identity(st))
        if found is None:
            return
        with contextlib.suppress(OSError, ValueError):
            if any(_identity(os.stat(path)) == _identity(st) for path in allow):
                return
        kind, path = found
        raise GraphoptError(f"{out}: the {what} would overwrite the {kind} {path!r}")


def input_files(source) -> list[tuple[str, os.stat_result, bool]]:
    """(name, stat, is the model itself) of every file the input consists of: the model and,
    for a loaded model, each external data file it references."""
    found = []
    path = source.path if isinstance(source, Model) else source
    if path:
        with contextlib.suppress(OSError, ValueError):
            found.append((os.fspath(path), os.stat(path), True))
    if isinstance(source, Model) and source.external is not None:
        found += [(location, st, False) for location, st in source.external.stats()]
    return found


def refuse_input_files(out: str, source, in_place: bool = False, *,
                       what: str = "output") -> None:
    """``out`` must not be (by symlink, ``..`` or hard link: the same inode) the input model,
    unless ``in_place``, nor any file the input references."""
    try:
        st = os.stat(out)
    except (OSError, ValueError):
        return  # nothing there (or a dangling symlink, which a rename replaces harmlessly)
    for name, input_st, is_model in input_files(source):
        if _identity(st) != _identity(input_st):
            continue
        if not is_model:
            raise GraphoptError(f"{out}: the {what} would overwrite the input's external "
                                f"data file {name!r}")
        if not in_place or what != "output":
            raise GraphoptError(f"{out}: would overwrite the input; pass --in-place to allow "
                                "it" if what == "output" else
                                f"{out}: the {what} would overwrite the input model")


def refuse_same_outputs(outputs: dict[str, str | None]) -> None:
    """Two outputs of one command (``-o`` and ``--report``...) must be different files."""
    seen: dict[tuple, str] = {}
    for option, path in outputs.items():
        if not path:
            continue
        keys = [("path", os.path.realpath(path))]
        with contextlib.suppress(OSError, ValueError):
            keys.append(("inode", *_identity(os.stat(path))))
        for key in keys:
            if key in seen and seen[key] != option:
                raise GraphoptError(f"{path}: {option} and {seen[key]} are the same file")
            seen.setdefault(key, option)


def save(model: Model, out: str, *, protect: ProtectedFiles | None = None,
         what: str = "output", reference_data: bool = False) -> list[str]:
    """Write atomically: temporary files in the output folder, fsync, then rename; returns
    the files published (the model, then its data file if it has one).

    External data goes to ``<out>.<digest>.data``, named after its content (by the input
    files it is copied from, unchanged: :meth:`ExternalFiles.fingerprint`), and is published
    before the model: a model file on disk only ever points at a complete data file. The
    publication (data file, then model) happens under a lock on the output folder, so two
    saves to the same path leave one of the two complete pairs. No file this save did not
    create is ever deleted: data files of earlier outputs stay (a copy of an earlier output
    may still use them); a save of the same content reuses its file.

    New files get the permissions the umask gives (like any other tool's); replacing an
    existing file keeps that file's permissions (``--in-place`` keeps the model's mode).
    ``protect``: files the output must not replace, checked again just before publishing.

    ``reference_data``: external tensors are not copied; the output points at the input's
    data files where they are (it must be written to the input's folder, and those files must
    then stay). Nothing of them is read: a 4.5 GB model is saved in the time its graph takes.
    Weights held inline in the input model are written inline as always."""
    refuse_input_files(out, model, in_place=True)  # its own data files: never (API callers too)
    refuse_special_file(out, what)

    def publish_checks(*paths: str) -> None:
        for path in paths:
            refuse_special_file(path, what)
            if protect is not None:
                protect.refuse(path, what)

    publish_checks(out)
    proto = model.flush()
    folder = os.path.dirname(os.path.abspath(out))
    stem = os.path.basename(out)
    mode = file_mode_for(out)
    remove_stale_temporaries(folder, stem)
    external = _external_tensors(proto)
    files = external_files(model) if external else None
    inline = _writes_inline(proto, files)
    to_data_file = [t for t in external if not inline(t)]
    if reference_data and to_data_file:
        check_reference_data(model, out)
        to_data_file = []  # each keeps its location, offset and length: the input's file
    staged: list[str] = []  # what to delete if the save fails
    try:
        if not to_data_file:
            model_tmp = _write_model_temp(proto, files, inline, folder, stem, mode, staged)
            publish_checks(out)
            _publish(model_tmp, out, staged)
            return [out]
        _refuse_what_the_disk_cannot_hold(to_data_file, folder, out)
        out_proto = onnx.ModelProto()
        out_proto.CopyFrom(proto)
        data_tmp, extents, digest = _stage_external_data(to_data_file, files, folder, stem,
                                                         mode, staged)
        size = os.stat(data_tmp).st_size
        with _folder_lock(folder):
            data_name, reuse = _data_name(folder, stem, digest, size)
            moved = [t for t in _external_tensors(out_proto) if not inline(t)]
            for tensor, (offset, length) in zip(moved, extents, strict=True):
                _set_external(tensor, location=data_name, offset=str(offset),
                              length=str(length))
            model_tmp = _write_model_temp(out_proto, files, inline, folder, stem, mode, staged)
            data_path = os.path.join(folder, data_name)
            publish_checks(out)
            if reuse:  # the same bytes are already there, under their name
                os.unlink(data_tmp)
            else:
                publish_checks(data_path)
                os.replace(data_tmp, data_path)
                staged.append(data_path)  # created by this save: removed if the model fails
            staged.remove(data_tmp)
            _publish(model_tmp, out, staged)
        return [out, data_path]
    except BaseException:
        for tmp_path in staged:
            with contextlib.suppress(OSError):
                os.unlink(tmp_path)
        raise


def _refuse_what_the_disk_cannot_hold(tensors, folder: str, out: str) -> None:
    """One line before copying external data the output folder's free space cannot hold (a
    sparse 40 GB input takes no disk, its copy takes 40 GB): the copy would otherwise run
    until the disk is full. A data file of the same bytes already there is reused, so this
    only refuses what a copy would need and cannot have."""
    needed = sum(int(dict((e.key, e.value) for e in t.external_data).get("length") or
                     (_byte_size(t) or 0)) for t in tensors)
    try:
        free = shutil.disk_usage(folder).free
    except OSError:
        return
    if needed > free:
        raise GraphoptError(f"{out}: its external data needs {needed:,} bytes and {folder} "
                            f"has {free:,} free; nothing was written (write it elsewhere, or "
                            "--reference-data to point at the input's data files)")


def check_reference_data(model: Model, out: str) -> None:
    """Locations are relative to the model's folder: an output can point at the input's data
    files (``reference_data``) only from the input's folder."""
    if model.external is None or not model.external.stats():
        return  # no external data file to point at
    base = model.external.base
    folder = os.path.dirname(os.path.abspath(out))
    if os.path.realpath(folder) != base:
        raise GraphoptError(f"--reference-data: the output must be written to the input's "
                            f"folder ({base}), where its data files are; it is "
                            f"{os.path.realpath(folder)}")


def _writes_inline(proto: onnx.ModelProto, files: ExternalFiles | None):
    """Which external tensors the output holds inline: the weights referenced in the input
    model file (it held them inline), as long as the output stays within protobuf's 2 GiB;
    past that, they go to the data file like the others."""
    if files is None or files.own_location is None:
        return lambda tensor: False
    _, total = weight_refs.encoded_pieces(proto, lambda t: _own_length(files, t))
    if total > MAX_MODEL_BYTES:
        return lambda tensor: False
    return files.is_own


def _own_length(files: ExternalFiles, tensor: onnx.TensorProto) -> int | None:
    return files.check(tensor)[2] if files.is_own(tensor) else None


# initializer bytes from which a model is written tensor by tensor (_write_model_temp)
STREAM_BYTES = 64 << 20


def _write_model_temp(proto, files, inline, folder, stem, mode, staged) -> str:
    """The model in a new temporary file, with the weights ``inline`` says are inline
    streamed into it from the input model file."""
    streamed = files is not None and any(inline(t) for t in proto.graph.initializer)
    if not streamed and sum(t.ByteSize() for t in proto.graph.initializer) < STREAM_BYTES:
        return _write_temp(folder, stem, proto.SerializeToString(), mode, staged)
    # initializer by initializer: protobuf's whole-model encoding holds the model's bytes
    # twice at once (its own string and Python's copy); a trained model's weights are in it
    pieces, _ = weight_refs.encoded_pieces(
        proto, lambda t: files.check(t)[2] if streamed and inline(t) else None)
    tmp = _temp_in(folder, stem, mode)
    staged.append(tmp)
    with open(tmp, "wb") as f:
        weight_refs.write_with_weights(pieces, f, lambda tensor, dst: files.copy(tensor, dst))
        f.flush()
        os.fsync(f.fileno())
    return tmp


def _publish(tmp: str, out: str, staged: list[str]) -> None:
    os.replace(tmp, out)
    staged.clear()
    _fsync_folder(os.path.dirname(os.path.abspath(out)))


def _fsync_folder(folder: str) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


@contextlib.contextmanager
def _folder_lock(folder: str):
    """An exclusive advisory lock on the output folder while a model and its data file are
    published (filesystems without flock: no lock, as before)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    fd = None
    with contextlib.suppress(OSError):
        fd = os.open(folder, os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)  # releases the lock


def _data_name(folder: str, stem: str, digest: str, size: int) -> tuple[str, bool]:
    """The data file's name and whether a file with exactly these bytes is already there
    (content-named, same size, a regular file). A different file under the name is kept and
    another name chosen."""
    for n in range(1000):
        suffix = f".{digest}{f'-{n}' if n else ''}.data"
        name = _fit_name(stem, suffix)
        try:
            st = os.lstat(os.path.join(folder, name))
        except FileNotFoundError:
            return name, False
        if stat.S_ISREG(st.st_mode) and st.st_size == size:
            return name, True
    raise GraphoptError(f"{folder}: too many data files named {stem}.{digest}*.data")


def _umask() -> int:
    with contextlib.suppress(OSError, ValueError), open("/proc/self/status") as f:
        for line in f:
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)  # elsewhere: read it by setting it (and set it back at once)
    os.umask(mask)
    return mask


def file_mode_for(out: str) -> int:
    """The permissions of the file being replaced, else what the umask gives a new file."""
    try:
        return stat.S_IMODE(os.stat(out).st_mode) & 0o777
    except (OSError, ValueError):
        return 0o666 & ~_umask()


# Temporary files: ``.<name>.graphopt-<host>-<pid>-<random>.tmp``, so that a later save can
# tell the ones of a process that died (SIGKILL, power loss) from those of a live one.
TEMP_TAG = "graphopt"
TEMP_SUFFIX = ".tmp"
STALE_SECONDS = 24 * 3600          # another host's temporary file untouched this long is dead
LEGACY_STALE_SECONDS = 3600        # temporaries named before the pid was part of the name
_TEMP_NAME = re.compile(rf"^\..+\.{TEMP_TAG}-(?P<host>[A-Za-z0-9_]+)-(?P<pid>[0-9]+)-"
                        r"[A-Za-z0-9_]+\.tmp$")


def host_tag() -> str:
    """This host's name as temporary-file names carry it (letters, digits, _)."""
    return "".join(c if c.isalnum() else "_" for c in socket.gethostname())[:32] or "host"


NAME_MAX = 255          # bytes in one file name (Linux, macOS; most filesystems)
_RANDOM_CHARS = 8       # what mkstemp adds


def _fit_name(stem: str, suffix: str, room: int = 0) -> str:
    """``stem + suffix``, the stem shortened (whole characters) so that the name, with
    ``room`` more bytes, stays within NAME_MAX: a valid output name of 250 bytes must not
    get a temporary or data file name that the filesystem refuses."""
    budget = NAME_MAX - room - len(suffix.encode("utf-8", "surrogateescape"))
    encoded = stem.encode("utf-8", "surrogateescape")
    if len(encoded) > budget:
        stem = encoded[:max(budget, 1)].decode("utf-8", "ignore")
    return stem + suffix


def _temp_in(folder: str, stem: str, mode: int | None = None) -> str:
    """A new file, created with O_EXCL under an unpredictable name (mkstemp) in ``folder``:
    nothing planted at a guessable name can redirect the write."""
    tag = f".{TEMP_TAG}-{host_tag()}-{os.getpid()}-"
    prefix = "." + _fit_name(stem, tag, room=1 + _RANDOM_CHARS + len(TEMP_SUFFIX))
    fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=TEMP_SUFFIX, dir=folder)
    try:
        os.fchmod(fd, file_mode_for(os.path.join(folder, stem)) if mode is None else mode)
    finally:
        os.close(fd)
    return tmp


def temporary_file(folder: str, stem: str, mode: int | None = None) -> str:
    """A new temporary file in ``folder`` for writing ``stem`` atomically, named so that
    :func:`remove_stale_temporaries` knows its writer (host, pid): another writer of graphopt
    files (checkpoints) takes its temporaries here, so one policy cleans up after all."""
    return _temp_in(folder, stem, mode)


def _write_temp(folder: str, stem: str, data: bytes, mode: int, staged: list[str]) -> str:
    tmp = _temp_in(folder, stem, mode)
    staged.append(tmp)
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return tmp


def remove_stale_temporaries(folder: str, stem: str | None = None) -> list[str]:
    """Remove graphopt's temporary files in ``folder`` left by processes that died: on this
    host, those whose process is gone; of another host, those untouched for a day; named the
    old way (no pid: ``.<stem>.XXXXXXXX.tmp``), those of ``stem`` untouched for an hour."""
    removed = []
    legacy = re.compile(rf"^\.{re.escape(stem)}(\.data)?\.[a-z0-9_]{{8}}\.tmp$") if stem else None
    now, me = time.time(), host_tag()
    try:
        names = os.listdir(folder)
    except OSError:
        return removed
    for name in names:
        if not name.startswith("."):
            continue
        path = os.path.join(folder, name)
        match = _TEMP_NAME.match(name)
        try:
            age = now - os.lstat(path).st_mtime
        except OSError:
            continue
        if match:
            pid = int(match["pid"])
            dead = (pid != os.getpid() and not process_alive(pid)) if match["host"] == me \
                else age > STALE_SECONDS
        else:
            dead = bool(legacy and legacy.match(name)) and age > LEGACY_STALE_SECONDS
        if dead:
            with contextlib.suppress(OSError):
                os.unlink(path)
                removed.append(name)
    return removed


def process_alive(pid: int) -> bool:
    """Whether a process of this host with that pid exists (it may belong to another user)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # exists, owned by someone else
        return True
    return True


def _set_external(tensor: onnx.TensorProto, **values: str) -> None:
    entries = {e.key: e.value for e in tensor.external_data}
    entries.update(values)
    del tensor.external_data[:]
    for key, value in entries.items():
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value


def _stage_external_data(external, files: ExternalFiles, folder, stem, mode, staged):
    """Copy every external tensor's bytes from the input's checked descriptors into one new
    temporary data file; returns that file, each tensor's (offset, length) in it and the
    digest that names it. The digest is of the sources' fingerprint
    (:meth:`ExternalFiles.fingerprint`: the same input files, unchanged, give the same
    bytes) and the kernel copies the bytes; a source changed too recently to be known by its
    times is read and the digest is of the content."""
    tmp = _temp_in(folder, stem + ".data", mode)
    staged.append(tmp)
    fingerprint = files.fingerprint(external)
    digest = hashlib.sha256(b"sources\n" + fingerprint)
    content = None if fingerprint else hashlib.sha256()
    extents = []
    with open(tmp, "wb") as dst:
        for source_tensor in external:
            pad = b"\0" * ((-dst.tell()) % 4096)
            dst.write(pad)
            if content is not None:
                content.update(pad)
            offset = dst.tell()
            extents.append((offset, files.copy(source_tensor, dst, content)))
        dst.flush()
        os.fsync(dst.fileno())
    return tmp, extents, (content or digest).hexdigest()[:DIGEST_CHARS]


@contextlib.contextmanager
def atomic_file(path: str, what: str = "output", *, protect: ProtectedFiles | None = None,
                binary: bool = True):
    """A file object on a new temporary file beside ``path`` (O_EXCL, unpredictable name);
    when the block ends it is synced and renamed onto ``path``: the path itself is replaced
    (a symlink there is replaced, never the file it points to; a hard link's other names keep
    the old content). On any failure (a full disk, SIGTERM, an error in the block) the
    temporary is removed and ``path`` keeps what it had; an OSError becomes one line."""
    folder = os.path.dirname(os.path.abspath(path))
    refuse_special_file(path, what)
    tmp = None
    try:
        tmp = _temp_in(folder, os.path.basename(path))
        with open(tmp, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8"})) \
                as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        refuse_special_file(path, what)
        if protect is not None:
            protect.refuse(path, what)
        os.replace(tmp, path)
        tmp = None
        _fsync_folder(folder)
    except OSError as exc:
        raise GraphoptError(f"{path}: cannot write the {what}: {exc.strerror or exc}") \
            from None
    finally:
        if tmp is not None:
            with contextlib.suppress(OSError):
                os.unlink(tmp)


def write_text_atomic(path: str, text: str, what: str = "output", *,
                      protect: ProtectedFiles | None = None) -> None:
    with atomic_file(path, what, protect=protect, binary=False) as f:
        f.write(text)


def open_for_appending(path: str, what: str, *, append: bool) -> object:
    """A text file for a log written as the run goes. A new log (or ``append`` false) is a
    new file, created as :func:`atomic_file` creates one and renamed onto ``path`` at once.
    An existing log is appended to only when it is a regular file with no other name (opened
    without following a symlink); through a symlink or a hard link its content is copied into
    a new file that replaces ``path``, so the file it points to, or shares its inode with, is
    never written. A FIFO or device is refused."""
    folder = os.path.dirname(os.path.abspath(path))
    refuse_special_file(path, what)
    try:
        if append:
            fd = _open_own_regular_for_append(path)
            if fd is not None:
                return os.fdopen(fd, "a", newline="", encoding="utf-8")
        previous = b""
        if append and os.path.lexists(path):
            fd, st = open_regular(path, what)
            try:
                previous = _pread_exactly(fd, st.st_size, 0, path)
            finally:
                os.close(fd)
        tmp = _temp_in(folder, os.path.basename(path))
        try:
            f = open(tmp, "a", newline="", encoding="utf-8")  # noqa: SIM115
            if previous:
                f.buffer.write(previous)
                f.flush()
            refuse_special_file(path, what)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise
        return f
    except OSError as exc:
        raise GraphoptError(f"{path}: cannot open the {what}: {exc.strerror or exc}") from None


def _open_own_regular_for_append(path: str) -> int | None:
    """An append descriptor on ``path`` when it is a regular file that is not a symlink and
    has one name only; None otherwise (also when it does not exist)."""
    flags = (os.O_WRONLY | os.O_APPEND | getattr(os, "O_NOFOLLOW", 0)
             | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0))
    try:
        fd = os.open(path, flags)
    except OSError:
        return None   # missing, a symlink (ELOOP), a FIFO without reader (ENXIO)
    st = os.fstat(fd)
    if stat.S_ISREG(st.st_mode) and st.st_nlink == 1:
        os.set_blocking(fd, True)
        return fd
    os.close(fd)
    return None

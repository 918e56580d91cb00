"""Loading and saving models: clear errors for bad files, atomic writes, external data.

Weights stored as external data are never read into memory on load; on save they are
streamed, in chunks, into one data file beside the output.
"""
from __future__ import annotations

import contextlib
import hashlib
import os
import re
import tempfile

import onnx
from google.protobuf.message import DecodeError

from .errors import GraphoptError
from .ir import Model
from .ir import external_tensors as _external_tensors

EXTERNAL_COPY_CHUNK = 64 << 20
DIGEST_CHARS = 12


def load(source, *, check: bool = True) -> Model:
    """Load a model from a path or a ModelProto; any problem is a one-line GraphoptError."""
    if isinstance(source, onnx.ModelProto):
        proto = onnx.ModelProto()
        proto.CopyFrom(source)
        path = None
    else:
        path = os.fspath(source)
        proto = _read_proto(path)
    _check_looks_like_onnx(proto, path)
    if check:
        _check_external_data(proto, path)
        try:
            onnx.checker.check_model(path if _uses_external_data(proto) and path else proto)
        except onnx.checker.ValidationError as exc:
            raise GraphoptError(f"{path or 'model'}: invalid ONNX model: {_first_line(exc)}") \
                from None
    return Model(proto, path)


def _read_proto(path: str) -> onnx.ModelProto:
    if not os.path.exists(path):
        raise GraphoptError(f"{path}: no such file")
    if os.path.isdir(path):
        raise GraphoptError(f"{path}: is a directory, not an ONNX file")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise GraphoptError(f"{path}: cannot read: {exc.strerror}") from None
    if not data:
        raise GraphoptError(f"{path}: empty file, not an ONNX model")
    proto = onnx.ModelProto()
    try:
        proto.ParseFromString(data)
    except (DecodeError, RuntimeError, ValueError):
        raise GraphoptError(f"{path}: not an ONNX model (protobuf parse failed; truncated?)") \
            from None
    return proto


def _check_looks_like_onnx(proto: onnx.ModelProto, path: str | None) -> None:
    where = path or "model"
    if proto.ir_version <= 0 or not proto.HasField("graph"):
        raise GraphoptError(f"{where}: not an ONNX model (no ir_version or graph)")
    if not proto.opset_import:
        raise GraphoptError(f"{where}: not an ONNX model (no opset_import)")
    newest = onnx.defs.onnx_opset_version()
    for opset in proto.opset_import:
        if opset.domain in ("", "ai.onnx") and not 1 <= opset.version <= newest:
            raise GraphoptError(f"{where}: unsupported opset {opset.version} (this onnx "
                                f"supports 1 to {newest})")


def _first_line(exc: Exception) -> str:
    text = str(exc).strip().splitlines()
    return " ".join(text[0].split()) if text else type(exc).__name__


def _uses_external_data(proto: onnx.ModelProto) -> bool:
    return bool(_external_tensors(proto))


def _external_info(tensor: onnx.TensorProto) -> dict[str, str]:
    return {e.key: e.value for e in tensor.external_data}


def _check_external_data(proto: onnx.ModelProto, path: str | None) -> None:
    """External data must stay inside the model's folder and exist: no path tricks."""
    tensors = _external_tensors(proto)
    if not tensors:
        return
    if path is None:
        raise GraphoptError("model has external data but was given without a path to find it")
    base = os.path.realpath(os.path.dirname(os.path.abspath(path)))
    for tensor in tensors:
        location = _external_info(tensor).get("location", "")
        target = os.path.realpath(os.path.join(base, location))
        if not location or os.path.isabs(location) or os.path.commonpath([base, target]) != base:
            raise GraphoptError(f"{path}: tensor '{tensor.name}' has external data outside "
                                f"the model's folder ({location!r})")
        if not os.path.isfile(target):
            raise GraphoptError(f"{path}: tensor '{tensor.name}' external data file "
                                f"{location!r} is missing")
        offset, length = _external_extent(tensor, path)
        available = os.path.getsize(target) - offset
        if length is None:
            length = available
        if offset + length > os.path.getsize(target):
            raise GraphoptError(f"{path}: tensor '{tensor.name}' external data runs past the "
                                f"end of {location!r}")
        expected = _byte_size(tensor)
        if expected is not None and expected != length:
            raise GraphoptError(f"{path}: tensor '{tensor.name}' declares {expected} bytes of "
                                f"external data but {location!r} holds {length} for it")


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


def check_output_path(out: str, source: str | None, in_place: bool) -> None:
    """Refuse before doing any work: a missing folder, or overwriting the input by accident."""
    folder = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(folder):
        problem = "is a file, not a folder" if os.path.exists(folder) else "does not exist"
        raise GraphoptError(f"{out}: output folder {folder} {problem}")
    if not os.access(folder, os.W_OK):
        raise GraphoptError(f"{out}: output folder {folder} is not writable")
    if os.path.isdir(out):
        raise GraphoptError(f"{out}: is a directory")
    if source and os.path.exists(out) and os.path.samefile(out, source) and not in_place:
        raise GraphoptError(f"{out}: would overwrite the input; pass --in-place to allow it")


def save(model: Model, out: str) -> None:
    """Write atomically: temporary files in the output folder, fsync, then rename.

    External data goes to ``<out>.<digest>.data``, named after its content, and is renamed
    into place before the model: a model file on disk only ever points at a complete data
    file of its own, even if the save stops half-way. Data files of earlier saves to the same
    path are removed once the new model is in place."""
    proto = model.flush()
    folder = os.path.dirname(os.path.abspath(out))
    stem = os.path.basename(out)
    external = _external_tensors(proto)
    staged: list[str] = []  # what to delete if the save fails
    try:
        data_name = None
        if external:
            proto, data_tmp, digest = _stage_external_data(proto, external, model.base_dir,
                                                           folder, stem, staged)
            data_name = f"{stem}.{digest}.data"
            for tensor in _external_tensors(proto):
                _set_external(tensor, location=data_name)
            data_path = os.path.join(folder, data_name)
            already_there = os.path.exists(data_path)  # same content: an earlier save's file
            os.replace(data_tmp, data_path)
            staged.remove(data_tmp)
            if not already_there:
                staged.append(data_path)
        tmp = _temp_in(folder, stem)
        staged.append(tmp)
        with open(tmp, "wb") as f:
            f.write(proto.SerializeToString())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
        staged.clear()
    except BaseException:
        for tmp_path in staged:
            with contextlib.suppress(OSError):
                os.unlink(tmp_path)
        raise
    _remove_stale_data_files(folder, stem, keep=data_name)


def _remove_stale_data_files(folder: str, stem: str, keep: str | None) -> None:
    pattern = re.compile(rf"^{re.escape(stem)}\.[0-9a-f]{{{DIGEST_CHARS}}}\.data$")
    for name in os.listdir(folder):
        if name != keep and pattern.match(name):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(folder, name))


def _temp_in(folder: str, stem: str) -> str:
    fd, tmp = tempfile.mkstemp(prefix=f".{stem}.", suffix=".tmp", dir=folder)
    os.close(fd)
    return tmp


def _set_external(tensor: onnx.TensorProto, **values: str) -> None:
    entries = {e.key: e.value for e in tensor.external_data}
    entries.update(values)
    del tensor.external_data[:]
    for key, value in entries.items():
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value


def _stage_external_data(proto, external, base_dir, folder, stem, staged):
    """Copy every external tensor's bytes, chunk by chunk, into one new temporary data file;
    returns the rewritten proto, that file and a digest of its content."""
    out_proto = onnx.ModelProto()
    out_proto.CopyFrom(proto)
    tensors = {t.name: t for t in _external_tensors(out_proto)}
    tmp = _temp_in(folder, stem + ".data")
    staged.append(tmp)
    digest = hashlib.sha256()
    with open(tmp, "wb") as dst:
        for source_tensor in external:
            info = _external_info(source_tensor)
            offset, length = int(info.get("offset", 0)), int(info.get("length", 0))
            src_path = os.path.join(base_dir, info["location"])
            if not length:
                length = os.path.getsize(src_path) - offset
            pad = b"\0" * ((-dst.tell()) % 4096)
            dst.write(pad)
            digest.update(pad)
            new_offset = dst.tell()
            with open(src_path, "rb") as src:
                src.seek(offset)
                remaining = length
                while remaining:
                    chunk = src.read(min(EXTERNAL_COPY_CHUNK, remaining))
                    if not chunk:
                        raise GraphoptError(f"external data for '{source_tensor.name}' ends early")
                    dst.write(chunk)
                    digest.update(chunk)
                    remaining -= len(chunk)
            _set_external(tensors[source_tensor.name], offset=str(new_offset),
                          length=str(length))
        dst.flush()
        os.fsync(dst.fileno())
    return out_proto, tmp, digest.hexdigest()[:DIGEST_CHARS]


def write_text_atomic(path: str, text: str) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    tmp = _temp_in(folder, os.path.basename(path))
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise

"""Training data: named arrays cut into batches along axis 0.

The order is a pure function of (seed, epoch): epoch ``e`` visits the samples in
``default_rng([seed, e]).permutation(n)``, in full batches (the last partial batch is
dropped, so every step has the same shapes). So the batch of any global step can be
recomputed from the step number alone, which is what makes ``--resume`` land exactly on
the uninterrupted run.
"""
from __future__ import annotations

import math
import os
import stat
import struct
import zipfile
import zlib
from collections.abc import Mapping, Sequence

import numpy as np

from graphopt.errors import GraphoptError
from graphopt.executor.memory import available_bytes, human


def load_npz(path: str, option: str = "--data") -> NpzArrays:
    """The arrays of a .npz file, read only when asked for (see NpzArrays); ``option``: the
    command-line option that named it, for the error line."""
    if not os.path.lexists(path):
        raise GraphoptError(f"{option} {path}: no such file")
    if not os.path.isfile(path):
        what = ("a folder" if os.path.isdir(path) else
                "a FIFO" if stat.S_ISFIFO(os.stat(path).st_mode) else
                "a broken link" if not os.path.exists(path) else "not a regular file")
        raise GraphoptError(f"{option} {path}: {what}, not a regular .npz file")
    return NpzArrays(path, option)


_LOCAL_HEADER = struct.Struct("<4s5H3L2H")  # a zip member's local file header


class NpzArrays(Mapping):
    """A .npz archive as a read-only mapping that reads nothing until an array is asked for.

    Listing the names reads the zip directory, once: the archive stays open, so asking for
    one array never parses the directory again (it did per array, which made an archive of
    8,000 members take minutes to open). Each array's .npy header (dtype, shape) is read,
    and its size checked against the memory the machine has, before a byte of its data is
    decompressed. Arrays stored uncompressed (``np.savez``) are memory-mapped, so batches
    are copied out row by row; compressed ones (``np.savez_compressed``) are decompressed
    when first read. Arrays the graph never reads cost nothing: not even their headers."""

    def __init__(self, path: str, option: str = "--data"):
        self.path, self.option = path, option
        try:
            self._archive = zipfile.ZipFile(path)
            infos = self._archive.infolist()
        except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
            reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise GraphoptError(f"{option} {path}: not a readable .npz file ({reason})") \
                from None
        self._members = {info.filename.removesuffix(".npy"): info for info in infos
                         if not info.is_dir()}
        self._loaded: dict[str, np.ndarray] = {}
        self._headers: dict[str, tuple] = {}   # name -> (shape, fortran, dtype, length)

    def close(self) -> None:
        """Close the archive (arrays already read, memory maps included, stay valid)."""
        self._archive.close()

    def __iter__(self):
        return iter(self._members)

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, name) -> bool:
        return name in self._members

    def __getitem__(self, name: str) -> np.ndarray:
        array = self._loaded.get(name)
        if array is None:
            info = self._members[name]  # KeyError for a name the archive lacks
            try:
                array = self._read(name, info)
            except GraphoptError:
                raise
            except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as exc:
                # zlib.error: a damaged member of a compressed (np.savez_compressed) archive
                raise self._unreadable(name, exc) from None
            self._loaded[name] = array
        return array

    def _unreadable(self, name: str, exc: BaseException) -> GraphoptError:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        return GraphoptError(f"{self.option} {self.path}: not a readable .npz file (array "
                             f"{name!r}: {reason})")

    def shape(self, name: str) -> tuple[int, ...]:
        """An array's shape from its .npy header, without reading its data."""
        array = self._loaded.get(name)
        if array is not None:
            return tuple(array.shape)
        header = self._headers.get(name)
        if header is None:
            try:
                with self._archive.open(self._members[name]) as stream:
                    header = self._header(stream)
            except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as exc:
                raise self._unreadable(name, exc) from None
            self._headers[name] = header
        return tuple(header[0])

    @staticmethod
    def _header(stream) -> tuple:
        version = np.lib.format.read_magic(stream)
        shape, fortran, dtype = (np.lib.format.read_array_header_1_0(stream)
                                 if version == (1, 0) else
                                 np.lib.format.read_array_header_2_0(stream))
        return shape, fortran, dtype, stream.tell()

    def _read(self, name: str, info: zipfile.ZipInfo) -> np.ndarray:
        with self._archive.open(info) as stream:
            shape, fortran, dtype, header_length = self._header(stream)
            self._headers[name] = (shape, fortran, dtype, header_length)
            if dtype.hasobject:
                raise GraphoptError(f"{self.option} {self.path}: array {name!r} holds Python "
                                    "objects (pickles are never loaded)")
            nbytes = math.prod(shape) * dtype.itemsize
            available = available_bytes(None)
            if available is not None and nbytes > available:
                raise GraphoptError(
                    f"{self.option} {self.path}: array {name!r} {tuple(shape)} {dtype} needs "
                    f"{human(nbytes)}, more than the {human(available)} available")
            if info.file_size != header_length + nbytes:
                raise GraphoptError(f"{self.option} {self.path}: array {name!r}: its header says "
                                    f"{nbytes} bytes of data, the archive holds "
                                    f"{info.file_size - header_length}")
            if info.compress_type != zipfile.ZIP_STORED or nbytes == 0:
                data = np.empty(nbytes, np.uint8)  # decompressed straight into place
                view, done = memoryview(data), 0
                while done < nbytes:
                    got = stream.readinto(view[done:])
                    if not got:
                        raise EOFError(f"the data ends after {done} of {nbytes} bytes")
                    done += got
                return data.view(dtype).reshape(shape, order="F" if fortran else "C")
        with open(self.path, "rb") as f:  # stored: map the bytes where they lie
            f.seek(info.header_offset)
            local = _LOCAL_HEADER.unpack(f.read(_LOCAL_HEADER.size))
            offset = (info.header_offset + _LOCAL_HEADER.size + local[-2] + local[-1]
                      + header_length)
        return np.memmap(self.path, dtype=dtype, mode="r", offset=offset, shape=tuple(shape),
                         order="F" if fortran else "C")


class ArrayShapes(Mapping):
    """Every array's shape by name, each read from its .npy header only when asked for:
    the training graph needs the labels' shape, not the other members'."""

    def __init__(self, arrays: NpzArrays):
        self._arrays = arrays

    def __getitem__(self, name: str) -> tuple[int, ...]:
        if name not in self._arrays:
            raise KeyError(name)
        return self._arrays.shape(name)

    def __contains__(self, name) -> bool:
        return name in self._arrays

    def __iter__(self):
        return iter(self._arrays)

    def __len__(self) -> int:
        return len(self._arrays)


def array_shapes(arrays: Mapping) -> Mapping[str, tuple[int, ...]]:
    """Every array's shape; an NpzArrays answers from the headers, reading no data, and only
    the headers of the arrays whose shape is asked for."""
    if isinstance(arrays, NpzArrays):
        return ArrayShapes(arrays)
    return {name: np.shape(value) for name, value in arrays.items()}


class Batches:
    """Batches of the arrays a training graph reads, in a seeded per-epoch order.

    ``accumulate``: the micro-batches of ``batch_size`` rows one optimizer step takes
    (gradient accumulation): step t reads rows ``t * batch_size * accumulate`` onwards of the
    epoch's order, ``micro_batches(t)`` hands them out a micro-batch at a time."""

    def __init__(self, arrays: Mapping[str, np.ndarray], input_names: Sequence[str],
                 batch_size: int, seed: int, input_types: Mapping[str, tuple] | None = None,
                 accumulate: int = 1):
        missing = [n for n in input_names if n not in arrays]
        if missing:
            raise GraphoptError(
                f"the data has no array for graph input(s) {missing}; it has "
                f"{sorted(arrays)} (name the arrays after the training graph's inputs "
                f"{list(input_names)})")
        self.arrays = {n: np.asarray(arrays[n]) for n in input_names}
        self.ignored = sorted(set(arrays) - set(input_names))
        lengths = {n: (a.shape[0] if a.ndim else None) for n, a in self.arrays.items()}
        if any(length is None for length in lengths.values()) or len(set(lengths.values())) > 1:
            raise GraphoptError(f"data arrays must share their length along axis 0; got {lengths}")
        self.size = next(iter(lengths.values())) if lengths else 0
        if batch_size < 1:
            raise GraphoptError(f"--batch-size must be >= 1, not {batch_size}")
        if batch_size > self.size:
            raise GraphoptError(f"--batch-size {batch_size} is larger than the data "
                                f"({self.size} samples)")
        if accumulate < 1:
            raise GraphoptError(f"--grad-accum must be >= 1, not {accumulate}")
        if batch_size * accumulate > self.size:
            raise GraphoptError(f"--batch-size {batch_size} x --grad-accum {accumulate} is "
                                f"larger than the data ({self.size} samples)")
        self.batch_size = batch_size
        self.accumulate = accumulate
        self.seed = seed
        self.steps_per_epoch = self.size // (batch_size * accumulate)
        self._check_types(input_types or {})
        self._order_epoch, self._order = None, None

    def _check_types(self, input_types: Mapping[str, tuple]) -> None:
        """Cast float data to the graph's float type; refuse what cannot match."""
        for name, (dtype, dims) in input_types.items():
            if name not in self.arrays:
                continue
            array = self.arrays[name]
            if dtype is not None and array.dtype != dtype:
                same_kind = (np.issubdtype(array.dtype, np.floating)
                             and np.issubdtype(dtype, np.floating)) \
                    or (np.issubdtype(array.dtype, np.integer) and np.issubdtype(dtype, np.integer))
                if not same_kind:
                    raise GraphoptError(f"data array {name!r} is {array.dtype}, the graph input "
                                        f"is {np.dtype(dtype)}")
                self.arrays[name] = array.astype(dtype)
            if dims is None:
                continue
            if len(dims) != array.ndim:
                raise GraphoptError(f"data array {name!r} has shape {array.shape}; the graph "
                                    f"input has rank {len(dims)} {dims}")
            if isinstance(dims[0], int) and dims[0] != self.batch_size:
                raise GraphoptError(f"graph input {name!r} has a fixed batch size {dims[0]}; "
                                    f"use --batch-size {dims[0]}")
            for axis in range(1, len(dims)):
                if isinstance(dims[axis], int) and dims[axis] != array.shape[axis]:
                    raise GraphoptError(f"data array {name!r} has shape {array.shape}; the "
                                        f"graph input is {dims}")

    def order(self, epoch: int) -> np.ndarray:
        if self._order_epoch != epoch:
            self._order = np.random.default_rng([self.seed, epoch]).permutation(self.size)
            self._order_epoch = epoch
        return self._order

    def position(self, step: int) -> tuple[int, int]:
        """(epoch, batch index in that epoch) of a global step (0-based)."""
        return divmod(step, self.steps_per_epoch)

    @property
    def samples_per_step(self) -> int:
        return self.batch_size * self.accumulate

    def rows(self, step: int, micro: int = 0) -> np.ndarray:
        """The data rows of micro-batch ``micro`` of a global step (0-based)."""
        epoch, index = self.position(step)
        first = (index * self.accumulate + micro) * self.batch_size
        return self.order(epoch)[first:first + self.batch_size]

    def batch(self, step: int, micro: int = 0) -> dict[str, np.ndarray]:
        rows = self.rows(step, micro)
        return {name: array[rows] for name, array in self.arrays.items()}

    def micro_batches(self, step: int) -> list[dict[str, np.ndarray]]:
        return [self.batch(step, micro) for micro in range(self.accumulate)]

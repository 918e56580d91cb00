"""Training data: named arrays cut into batches along axis 0.

The order is a pure function of (seed, epoch): epoch ``e`` visits the samples in
``default_rng([seed, e]).permutation(n)``, in full batches (the last partial batch is
dropped, so every step has the same shapes). So the batch of any global step can be
recomputed from the step number alone, which is what makes ``--resume`` land exactly on
the uninterrupted run.
"""
from __future__ import annotations

import os
import zipfile
import zlib
from collections.abc import Mapping, Sequence

import numpy as np

from graphopt.errors import GraphoptError


def load_npz(path: str) -> dict[str, np.ndarray]:
    if not os.path.isfile(path):
        raise GraphoptError(f"--data {path}: no such file")
    try:
        with np.load(path, allow_pickle=False) as archive:
            return {name: archive[name] for name in archive.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile, zlib.error) as exc:
        # zlib.error: a damaged member of a compressed (np.savez_compressed) archive
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise GraphoptError(f"--data {path}: not a readable .npz file ({reason})") from None


class Batches:
    """Batches of the arrays a training graph reads, in a seeded per-epoch order."""

    def __init__(self, arrays: Mapping[str, np.ndarray], input_names: Sequence[str],
                 batch_size: int, seed: int, input_types: Mapping[str, tuple] | None = None):
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
        self.batch_size = batch_size
        self.seed = seed
        self.steps_per_epoch = self.size // batch_size
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

    def batch(self, step: int) -> dict[str, np.ndarray]:
        epoch, index = self.position(step)
        rows = self.order(epoch)[index * self.batch_size:(index + 1) * self.batch_size]
        return {name: array[rows] for name, array in self.arrays.items()}

"""Per-session kernel context: what every kernel may read besides its inputs."""

from __future__ import annotations

from typing import Any

import numpy as np

from .backend import ArrayBackend
from .blas_threads import BlasThreads
from .host_memory import SpareBlocks, keeps_memory


class KernelContext:
    """``xp`` is numpy or cupy; ``numerics`` the FP16 policy object or None; ``training``
    the default Dropout mode for graphs that do not say; ``evaluating`` set inside
    ``Session.inference_mode`` (a training graph run as model.eval() runs it: its
    training-mode BatchNorm normalises with the running statistics); ``yield_feeds`` the
    caller-given gradients for YieldOp outputs during one run; ``donated`` the inputs of the running
    node that the kernel may overwrite (see ``out_for``); ``blas`` the BLAS thread count
    that ``Session.run`` holds lowered between small products (blas_threads.BlasThreads);
    ``spares`` the large arrays earlier steps and runs released (host_memory.SpareBlocks;
    None on a GPU, where CuPy's memory pool does the same, and where the environment says
    ``GRAPHOPT_KEEP_HOST_MEMORY=0``), handed out by ``large_out``; ``memory`` the session's
    MemoryGuard (None when the memory check is off), which memory.check_allocation asks."""

    __slots__ = ("backend", "xp", "numerics", "training", "evaluating", "yield_feeds", "donated",
                 "blas", "spares", "memory", "_rng", "_node_rngs", "_host_constants", "_host_made")

    def __init__(self, backend: ArrayBackend, numerics: Any, training: bool, seed: int | None):
        self.backend = backend
        self.xp = backend.xp
        self.numerics = numerics
        self.training = training
        self.evaluating = False
        self.yield_feeds: dict[str, Any] = {}
        self.donated: tuple = ()
        self.blas = BlasThreads()
        self.spares = SpareBlocks() if self.xp is np and keeps_memory() else None
        self.memory = None
        self._rng = np.random.default_rng(seed)
        self._node_rngs: dict[str, np.random.Generator] = {}
        # Host copies of small integer device arrays (shapes, axes): id -> (array, host copy).
        # The array is held so its id cannot be reused; a kernel reading such a tensor as
        # Python ints then needs no blocking device->host copy. Constants (integer
        # initializers) live with the session, what kernels made lives for one run.
        self._host_constants: dict[int, tuple[Any, np.ndarray]] = {}
        self._host_made: dict[int, tuple[Any, np.ndarray]] = {}

    def out_for(self, shape, dtype, *candidates, any_layout: bool = False):
        """A donated input among ``candidates`` that can hold a result of ``shape`` and
        ``dtype`` (for ``out=``), or None: the caller then allocates as usual.

        A donated view (a transposed one, say) is handed out only to a kernel that says
        ``any_layout``: one that lays out its result as its input either way. Another
        kernel would leave its result in the view's layout where it would have allocated
        another, and the layout decides the order in which later reductions add: the bits
        would then depend on which buffers happened to be reused (and differ from a GPU
        run's, which reuses none)."""
        for array in candidates:
            if (array.shape == shape and array.dtype == dtype
                    and (any_layout or array.base is None)
                    and any(array is d for d in self.donated)):
                return array
        return None

    def large_out(self, shape, dtype):
        """A spare C-contiguous array of ``shape`` and ``dtype`` for a kernel to write its
        whole result into (``out=``), when the result is large enough for glibc to map it
        afresh (host_memory.LARGE_BYTES); else None: the caller allocates as usual."""
        spares = self.spares
        if not spares:  # None, or nothing kept now
            return None
        return spares.take(shape, dtype)

    def host_ints(self, array) -> list[int]:
        """Small integer tensors (shapes, axes, starts) as Python ints."""
        return [int(v) for v in self._on_host(array).reshape(-1)]

    def host_scalar(self, array):
        return self._on_host(array).reshape(-1)[0].item()

    def device_ints(self, values) -> Any:
        """An int64 tensor of ``values`` (computed on the host: a shape, a size) on the
        session's device, its host copy remembered for the rest of the run."""
        host = np.asarray(values, dtype=np.int64)
        array = self.xp.asarray(host)
        if array is not host:
            self._host_made[id(array)] = (array, host)
        return array

    def remember_constant(self, array, host: np.ndarray) -> None:
        """``host`` is the value of the device array ``array`` for the session's lifetime."""
        if array is not host:
            self._host_constants[id(array)] = (array, host)

    def forget_made(self) -> None:
        """The end of a run: what kernels made is gone."""
        self._host_made.clear()

    def _on_host(self, array) -> np.ndarray:
        known = self._host_made.get(id(array)) or self._host_constants.get(id(array))
        if known is not None and known[0] is array:
            return known[1]
        return np.asarray(self.backend.to_host(array))

    def uniform(self, shape, node_name: str = "", seed: int | None = None) -> Any:
        """Uniform [0, 1) float32 samples on the session's device. A node with its own
        ``seed`` attribute gets its own generator, created once, so its stream is
        reproducible across sessions and still advances from run to run."""
        rng = self._rng
        if seed is not None:
            rng = self._node_rngs.get(node_name)
            if rng is None:
                rng = self._node_rngs[node_name] = np.random.default_rng(seed)
        elif self.backend.is_gpu:
            return self.xp.random.random_sample(shape, dtype=np.float32)
        return self.backend.to_device(rng.random(shape, dtype=np.float32))

    def reseed(self, seed: int) -> None:
        self._rng = np.random.default_rng(seed)
        self._node_rngs.clear()
        if self.backend.is_gpu:
            self.xp.random.seed(seed)

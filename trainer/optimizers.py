"""Optimizers over named float32 master weights, with PyTorch's update formulas (so a
graphopt run and a torch run of the same model agree step for step).

Every optimizer updates ``params`` (name -> numpy array) in place from ``grads`` (name ->
float32 array) and keeps its state as named arrays plus a few scalars, which the checkpoint
stores as they are (bit-exact resume).

Weight decay, as the transformers Trainer (and nanoGPT) apply it, skips biases and norm
weights: tensors of rank < 2 are updated without it, matrices, convolution kernels and
embeddings with it. ``decay_all`` decays every tensor, as a bare torch.optim optimizer does.

Parameters may also live on a GPU (CuPy arrays): the state is then created on the same
device, ``state()`` still hands the checkpoint host arrays, and AdamW updates each parameter
with one fused kernel (``ADAMW_BODY``) that does NumPy's float32 operations in NumPy's order
with explicitly rounded multiplies and adds (no fused multiply-add contraction), so a GPU
step gives the host's bits.
"""
from __future__ import annotations

import math

import numpy as np

from graphopt.errors import GraphoptError
from graphopt.executor.kernels._compiled import compiled_kernels
from graphopt.executor.kernels._threads import run_blocks

# elements of a float32 host weight updated at a time (Optimizer._update_in_chunks): 256 KiB,
# within a core's L2 cache
UPDATE_CHUNK = 1 << 16
# AdamW updates float32 host weights of at most this many elements in all as one flat array
# (AdamW._flat_step): ~15 NumPy calls in all instead of ~15 per weight, which matters for
# many small weights; a larger model's update is dominated by its arithmetic, and the flat
# copies would cost two more copies of every weight and gradient
FLAT_STEP_LIMIT = 1 << 22


def updatable_in_place(param) -> bool:
    """Whether a weight is updated in place, chunk by chunk: a writable contiguous float32
    host array (a float16 master or a GPU weight is updated as a whole float32 array)."""
    return (type(param) is np.ndarray and param.dtype == np.float32
            and param.flags.c_contiguous and param.flags.writeable)


class Optimizer:
    name = ""   # what --optimizer calls it (see OPTIMIZERS)
    default_weight_decay = 0.0   # without --weight-decay
    slot_names: tuple[str, ...] = ()   # the arrays it keeps per weight (after its first step)
    # the scalars state() writes besides name and steps, and what each must be: "positive",
    # "non-negative" (finite numbers) or "bool"; a subclass adds its hyperparameters'
    scalar_kinds = {"lr": "positive", "weight_decay": "non-negative", "decay_all": "bool"}

    @classmethod
    def scalars_problem(cls, scalars: dict) -> str | None:
        """What in a checkpoint's optimizer scalars this optimizer's state() never writes
        (None: nothing): a checkpoint checks its optimizer through this, so a new optimizer
        or hyperparameter needs no checkpoint code."""
        for key, value in scalars.items():
            if key in ("name", "steps"):
                continue
            kind = cls.scalar_kinds.get(key)
            if kind is None:
                return f"optimizer {key} is no scalar of {cls.name}"
            if kind == "bool":
                if not isinstance(value, bool):
                    return f"optimizer {key} is {value!r}, not true/false"
            elif isinstance(value, bool) or not isinstance(value, int | float) \
                    or not math.isfinite(value) or value < 0 or (kind == "positive"
                                                                 and value == 0):
                return f"optimizer {key} is {value!r}, not a finite number " \
                       f"{'> 0' if kind == 'positive' else '>= 0'}"
        return None

    def __init__(self, lr: float, weight_decay: float = 0.0, decay_all: bool = False):
        # an infinite rate or decay would only turn every weight into NaN at the first step
        if not (lr > 0 and math.isfinite(lr)):
            raise GraphoptError(f"--lr must be a finite number > 0, not {lr}")
        if not (weight_decay >= 0 and math.isfinite(weight_decay)):
            raise GraphoptError(f"--weight-decay must be a finite number >= 0, not {weight_decay}")
        self.lr = float(lr)
        self.weight_decay = float(weight_decay)
        self.decay_all = bool(decay_all)   # False: no decay on tensors of rank < 2
        self.steps = 0  # updates applied (skipped loss-scale steps do not count)
        self.slots: dict[str, dict[str, np.ndarray]] = {}

    def step(self, params: dict[str, np.ndarray], grads: dict[str, np.ndarray],
             lr_factor: float = 1.0) -> None:
        """One update; ``lr_factor`` scales ``lr`` for this update only (a schedule)."""
        self.steps += 1
        base, decay = self.lr, self.weight_decay
        self.lr = base * lr_factor
        try:
            for group_decay, group in self.decay_groups(params):
                self.weight_decay = group_decay
                self._step_group(group, grads)
        finally:
            self.lr, self.weight_decay = base, decay

    def decay_groups(self, params: dict) -> list[tuple[float, dict]]:
        """(weight decay, the weights updated with it): one group, or the decayed tensors
        (rank >= 2) and the rest (biases, norm weights) at 0, the empty one left out."""
        if self.decay_all or not self.weight_decay:
            return [(self.weight_decay, params)]
        decayed = {n: p for n, p in params.items() if p.ndim >= 2}
        exempt = {n: p for n, p in params.items() if p.ndim < 2}
        return [(d, group) for d, group in ((self.weight_decay, decayed), (0.0, exempt))
                if group]

    def _step_group(self, params: dict, grads: dict) -> None:
        """The update of one decay group, ``lr`` and ``weight_decay`` set for it."""
        self._update_host(params, grads)

    def _update_host(self, params: dict[str, np.ndarray], grads: dict[str, np.ndarray]
                     ) -> None:
        """Update host weights, each in place chunk by chunk where it is a float32 array, else
        through a float32 copy: the arithmetic runs in float32 whatever the master dtype
        ("fp16" precision keeps float16 masters: the rounding is part of that experiment)."""
        # a huge (finite) --lr overflows here: the next step reports the non-finite weight in
        # one line, so numpy's own warnings would only be noise before it
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            for name, param in params.items():
                if updatable_in_place(param):
                    self._update_in_chunks(name, param, grads[name])
                    continue
                value = param.astype(np.float32)
                self._update(name, value, grads[name].astype(np.float32, copy=False))
                param[...] = value

    def _update_in_chunks(self, name: str, param: np.ndarray, grad: np.ndarray) -> None:
        """The update of a float32 host weight in place, UPDATE_CHUNK elements at a time: the
        same elementwise float32 operations as one whole-array update (so the same bits), with
        temporaries of a chunk's size instead of the weight's (a 1.1B Falcon's 65024 x 2048
        embedding would make several 532 MB ones per update) that stay in the CPU's cache."""
        fresh = name not in self.slots
        slots = {slot: self._slot(name, slot, param).reshape(-1) for slot in self.slot_names}
        weights = param.reshape(-1)
        gradient = np.ascontiguousarray(grad, dtype=np.float32).reshape(-1)
        for start in range(0, weights.size, UPDATE_CHUNK):
            part = slice(start, start + UPDATE_CHUNK)
            self._apply(weights[part], gradient[part],
                        {slot: array[part] for slot, array in slots.items()}, fresh)

    def _update(self, name: str, param: np.ndarray, grad: np.ndarray) -> None:
        """The update of a whole float32 array (a copy of a float16 master, a GPU weight)."""
        fresh = name not in self.slots
        self._apply(param, grad, {slot: self._slot(name, slot, param)
                                  for slot in self.slot_names}, fresh)

    def _apply(self, param: np.ndarray, grad: np.ndarray, slots: dict[str, np.ndarray],
               fresh: bool) -> None:
        """The update's arithmetic, elementwise, in place on ``param`` and ``slots`` (this
        weight's state arrays, or the same parts of them as ``param`` is of its weight);
        ``fresh``: the weight's first update."""
        raise NotImplementedError

    def _slot(self, param_name: str, slot: str, like: np.ndarray) -> np.ndarray:
        """The float32 state array ``slot`` of a parameter, on the parameter's device."""
        slots = self.slots.setdefault(param_name, {})
        xp = array_module(like)
        if slot not in slots:
            slots[slot] = xp.zeros(like.shape, np.float32)
        elif array_module(slots[slot]) is not xp:  # loaded from a checkpoint (host arrays)
            slots[slot] = xp.asarray(slots[slot])
        return slots[slot]

    def release(self) -> None:
        """Drop the state after the last update (its checkpoint, if any, was written): the
        memory goes back before the trained weights are written out."""
        self.slots = {}

    # -- checkpoint -------------------------------------------------------------------------
    def state(self) -> tuple[dict, dict[str, np.ndarray]]:
        """(JSON-able scalars, named arrays)."""
        arrays = {f"{param}/{slot}": to_host(value) for param, slots in self.slots.items()
                  for slot, value in slots.items()}
        return {"name": self.name, "lr": self.lr, "weight_decay": self.weight_decay,
                "decay_all": self.decay_all, "steps": self.steps, **self._hyper()}, arrays

    def load_state(self, scalars: dict, arrays: dict[str, np.ndarray]) -> None:
        mine, _ = self.state()
        # a checkpoint without the key decayed every tensor
        scalars = {"decay_all": True, **scalars}
        for key in mine:
            if key != "steps" and scalars.get(key) != mine[key]:
                raise GraphoptError(
                    f"checkpoint optimizer {key} is {scalars.get(key)!r}, this run has "
                    f"{mine[key]!r}; resume with the same optimizer settings")
        self.steps = int(scalars["steps"])
        self.slots = {}
        for key, value in arrays.items():
            param, slot = key.rsplit("/", 1)
            self.slots.setdefault(param, {})[slot] = np.array(value, np.float32)

    def check_arrays(self, arrays: dict[str, np.ndarray], steps: int,
                     params: dict[str, np.ndarray]) -> None:
        """A checkpoint's arrays must be exactly this optimizer's slots of every weight (none
        before the first update), each shaped like its weight."""
        expected = {f"{p}/{slot}" for p in params for slot in self.slot_names} if steps else set()
        wrong = sorted(set(arrays) ^ expected)
        if wrong:
            raise GraphoptError(f"checkpoint optimizer arrays {wrong[:3]} do not fit {self.name} "
                                f"after {steps} update(s) of these weights")
        for key, value in arrays.items():
            shape = params[key.rsplit("/", 1)[0]].shape
            if value.shape != shape:
                raise GraphoptError(f"checkpoint optimizer array {key!r} has shape "
                                    f"{value.shape}, its weight {shape}")

    def _hyper(self) -> dict:
        return {}


class SGD(Optimizer):
    """torch.optim.SGD without momentum: p -= lr * (g + wd * p) (L2 decay, coupled)."""
    name = "sgd"

    def _apply(self, param, grad, slots, fresh):
        if self.weight_decay:
            grad = grad + self.weight_decay * param
        param -= self.lr * grad


class Momentum(Optimizer):
    """torch.optim.SGD(momentum=m): buf = m * buf + g (buf = g on the first step)."""
    name = "momentum"
    slot_names = ("momentum",)
    scalar_kinds = {**Optimizer.scalar_kinds, "momentum": "non-negative"}

    def __init__(self, lr, weight_decay=0.0, decay_all: bool = False, momentum: float = 0.9):
        super().__init__(lr, weight_decay, decay_all)
        self.momentum = float(momentum)

    def _hyper(self):
        return {"momentum": self.momentum}

    def _apply(self, param, grad, slots, fresh):
        if self.weight_decay:
            grad = grad + self.weight_decay * param
        buf = slots["momentum"]
        if fresh:
            buf[...] = grad
        else:
            buf *= self.momentum
            buf += grad
        param -= self.lr * buf


class AdamW(Optimizer):
    """torch.optim.AdamW: decoupled decay p *= 1 - lr * wd, then Adam with bias correction,
    in torch's order of operations (denominator sqrt(v) / sqrt(bc2) + eps)."""
    name = "adamw"
    slot_names = ("exp_avg", "exp_avg_sq")
    scalar_kinds = {**Optimizer.scalar_kinds, "beta1": "non-negative",
                    "beta2": "non-negative", "eps": "non-negative"}
    default_weight_decay = 0.01   # torch.optim.AdamW's

    def __init__(self, lr, weight_decay=0.01, decay_all: bool = False, betas=(0.9, 0.999),
                 eps: float = 1e-8):
        super().__init__(lr, weight_decay, decay_all)
        self.beta1, self.beta2 = (float(b) for b in betas)
        self.eps = float(eps)
        # layout -> (flat arrays, spans) of _flat_step: one per decay group
        self._flat: dict[tuple, tuple] = {}

    def _hyper(self):
        return {"beta1": self.beta1, "beta2": self.beta2, "eps": self.eps}

    def release(self) -> None:
        super().release()
        self._flat = {}

    def _step_group(self, params, grads) -> None:
        device = [name for name, param in params.items() if array_module(param) is not np]
        if not device:
            if (all(param.dtype == np.float32 for param in params.values())
                    and sum(param.size for param in params.values()) <= FLAT_STEP_LIMIT):
                return self._flat_step(params, grads)
            return self._update_host(params, grads)
        self._update_host({name: param for name, param in params.items()
                           if name not in device}, grads)
        for name in device:
            self._fused_update(name, params[name], grads[name])
        return None

    def _scalars(self):
        """The float32 constants NumPy's float32 arithmetic in ``_update`` uses."""
        f32 = np.float32
        bias1 = 1.0 - self.beta1 ** self.steps
        bias2 = 1.0 - self.beta2 ** self.steps
        return (f32(1.0 - self.lr * self.weight_decay), f32(self.beta1), f32(1.0 - self.beta1),
                f32(self.beta2), f32(1.0 - self.beta2), f32(np.sqrt(bias2)), f32(self.eps),
                f32(self.lr / bias1))

    def _fused_update(self, name, param, grad):
        xp = array_module(param)
        m = self._slot(name, "exp_avg", param)
        v = self._slot(name, "exp_avg_sq", param)
        kernel = _adamw_kernel(xp)
        kernel(grad, *self._scalars(), param, m, v)

    def _flat_step(self, params, grads) -> None:
        """The host step of float32 weights as one update of all of them: the weights,
        gradients and both slots laid end to end, the same float32 operations in the same
        order (so the same bits: every one is elementwise) in about 15 NumPy calls instead of
        15 per weight (~0.5 ms of a 16 ms step for the MQA example's 16 weights). The
        slots stay one array per weight for checkpoints: views of the flat ones."""
        flat, spans = self._flat_buffers(params)
        weights, gradients = flat["param"], flat["grad"]
        for name, (start, stop) in spans.items():
            weights[start:stop] = params[name].reshape(-1)
            gradients[start:stop] = grads[name].reshape(-1)  # a float16 grad: as astype
        with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
            self._arithmetic(weights, gradients, flat["exp_avg"], flat["exp_avg_sq"])
        for name, (start, stop) in spans.items():
            params[name][...] = weights[start:stop].reshape(params[name].shape)

    def _flat_buffers(self, params) -> tuple[dict, dict]:
        """The flat float32 arrays for these weights (made again when the weights change) with
        each weight's span; each slot of self.slots a view of its flat array (a slot loaded
        from a checkpoint, or left by another layout, is copied in first)."""
        layout = tuple((name, param.shape) for name, param in params.items())
        cached = self._flat.get(layout)
        if cached is None:
            spans, start = {}, 0
            for name, param in params.items():
                spans[name] = (start, start + param.size)
                start += param.size
            flat = {key: np.zeros(start, np.float32)
                    for key in ("param", "grad", *self.slot_names)}
            cached = self._flat[layout] = (flat, spans)
        flat, spans = cached
        for name, (start, stop) in spans.items():
            slots = self.slots.setdefault(name, {})
            for slot in self.slot_names:
                whole = flat[slot]
                current = slots.get(slot)
                if current is not None and current.base is whole:
                    continue  # already the view
                whole[start:stop] = 0.0 if current is None else np.asarray(current).reshape(-1)
                slots[slot] = whole[start:stop].reshape(params[name].shape)
        return flat, spans

    def _apply(self, param, grad, slots, fresh):
        self._arithmetic(param, grad, slots["exp_avg"], slots["exp_avg_sq"])

    def _update_in_chunks(self, name: str, param: np.ndarray, grad: np.ndarray) -> None:
        # the compiled update makes no temporaries: the whole weight in one call
        if self._compiled_update(param.reshape(-1), np.asarray(grad).reshape(-1),
                                 self._slot(name, "exp_avg", param).reshape(-1),
                                 self._slot(name, "exp_avg_sq", param).reshape(-1)):
            return
        super()._update_in_chunks(name, param, grad)

    def _compiled_update(self, param, grad, m, v) -> bool:
        """The update in one compiled pass over threads, when numba's kernels run and the
        four arrays are flat, contiguous float32 host arrays of one size: the same bits as
        _arithmetic's NumPy passes, without their five reads and writes of each array."""
        arrays = (param, grad, m, v)
        if not all(isinstance(a, np.ndarray) and a.dtype == np.float32 and a.ndim == 1
                   and a.flags.c_contiguous for a in arrays) or \
                len({a.size for a in arrays}) != 1:
            return False
        kernels = compiled_kernels(np, param.dtype, param.size)
        if kernels is None or not param.flags.writeable:
            return False
        scalars = self._scalars()
        run_blocks(lambda start, stop: kernels.adamw_flat(
            param[start:stop], grad[start:stop], m[start:stop], v[start:stop], *scalars),
            param.size, UPDATE_CHUNK)
        return True

    def _arithmetic(self, param, grad, m, v):
        """One AdamW update of float32 arrays in place (the order of operations is torch's)."""
        if self._compiled_update(param, grad, m, v):
            return
        param *= 1.0 - self.lr * self.weight_decay
        m *= self.beta1
        m += (1.0 - self.beta1) * grad
        v *= self.beta2
        v += (1.0 - self.beta2) * grad * grad
        bias1 = 1.0 - self.beta1 ** self.steps
        bias2 = 1.0 - self.beta2 ** self.steps
        denom = np.sqrt(v) / np.float32(np.sqrt(bias2)) + np.float32(self.eps)
        param -= np.float32(self.lr / bias1) * (m / denom)


# --optimizer NAME -> the class; a new optimizer is one more subclass named here
OPTIMIZERS = {cls.name: cls for cls in (SGD, Momentum, AdamW)}


def array_module(array):
    """numpy for host arrays, else the array's own module (``cupy`` for a CuPy array)."""
    if isinstance(array, np.ndarray) or np.isscalar(array):
        return np
    import importlib  # noqa: PLC0415

    return importlib.import_module(type(array).__module__.split(".")[0])


def to_host(array) -> np.ndarray:
    return array.get() if hasattr(array, "get") else np.asarray(array)


# One AdamW step for one element: ``_update``'s float32 operations in its order, each
# multiply/add/subtract explicitly rounded (__fmul_rn/__fadd_rn/__fsub_rn: no FMA
# contraction), division and sqrt IEEE-rounded (the CUDA/HIP defaults), so the bits are
# NumPy's. p is the master weight (float32 or float16), rounded back once at the end.
ADAMW_BODY = r"""
    float p = __fmul_rn((float)param, decay);
    float g = (float)grad;
    float m1 = __fadd_rn(__fmul_rn(m, beta1), __fmul_rn(one_minus_beta1, g));
    float v1 = __fadd_rn(__fmul_rn(v, beta2), __fmul_rn(__fmul_rn(one_minus_beta2, g), g));
    float denom = __fadd_rn(sqrtf(v1) / sqrt_bias2, eps);
    p = __fsub_rn(p, __fmul_rn(step_size, m1 / denom));
    m = m1;
    v = v1;
    param = (P)p;
"""

_ADAMW_KERNELS: dict = {}


def _adamw_kernel(xp):
    kernel = _ADAMW_KERNELS.get(xp)
    if kernel is None:
        kernel = _ADAMW_KERNELS[xp] = xp.ElementwiseKernel(
            "G grad, float32 decay, float32 beta1, float32 one_minus_beta1, float32 beta2, "
            "float32 one_minus_beta2, float32 sqrt_bias2, float32 eps, float32 step_size",
            "P param, float32 m, float32 v", ADAMW_BODY, "graphopt_adamw_step")
    return kernel


def make_optimizer(name: str, lr: float, weight_decay: float | None = None,
                   decay_all: bool = False) -> Optimizer:
    """``decay_all``: weight decay on every tensor, not only those of rank >= 2."""
    if name not in OPTIMIZERS:
        raise GraphoptError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZERS)}")
    cls = OPTIMIZERS[name]
    return cls(lr, cls.default_weight_decay if weight_decay is None else weight_decay,
               decay_all)

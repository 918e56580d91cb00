"""Loss scaling for FP16 training: the YieldOp is handed ``scale`` instead of 1 as the loss
gradient, so every gradient comes back multiplied by it (small gradients move out of the
FP16 subnormal range, where MI200's original GEMMs flush them), and is divided by it in
float32 before the optimizer sees it.

Specs: ``none``, ``static:N``, ``dynamic`` or ``dynamic:INIT[:INTERVAL]`` (PyTorch
GradScaler / ORT semantics: start at INIT (2**16), double after INTERVAL (2000) overflow-free
steps, halve on an overflow and skip that step).
"""
from __future__ import annotations

import numpy as np

from graphopt.errors import GraphoptError

DEFAULT_INIT = 2.0 ** 16
DEFAULT_INTERVAL = 2000
MIN_SCALE = 1.0  # below 1 scaling would only push gradients further into the subnormals
# the scale is fed to the graph as a float32 (or float16) tensor: beyond float32's range it
# is inf there, every gradient is inf or NaN, and a dynamic scale halved from inf stays inf
MAX_SCALE = float(np.finfo(np.float32).max)


class LossScaler:
    """Static scaling (``none`` is static 1): an overflow still skips the step."""

    dynamic = False

    def __init__(self, scale: float = 1.0):
        self.scale = float(scale)
        self.skipped = 0

    def update(self, overflow: bool) -> bool:
        """Record one step's outcome; True if its update must be applied."""
        if overflow:
            self.skipped += 1
        return not overflow

    def describe(self) -> str:
        return "none" if self.scale == 1.0 else f"static {self.scale:g}"

    def state(self) -> dict:
        return {"kind": "dynamic" if self.dynamic else "static", "scale": self.scale,
                "skipped": self.skipped}

    def load_state(self, state: dict) -> None:
        kind = "dynamic" if self.dynamic else "static"
        if state.get("kind") != kind:
            raise GraphoptError(f"checkpoint used {state.get('kind')} loss scaling, this run "
                                f"uses {kind}")
        self.scale = float(state["scale"])
        self.skipped = int(state["skipped"])


class DynamicLossScaler(LossScaler):
    dynamic = True

    def __init__(self, init: float = DEFAULT_INIT, interval: int = DEFAULT_INTERVAL):
        super().__init__(init)
        self.interval = int(interval)
        self.good_steps = 0

    def update(self, overflow: bool) -> bool:
        if overflow:
            self.skipped += 1
            self.good_steps = 0
            self.scale = max(self.scale / 2.0, MIN_SCALE)
            return False
        self.good_steps += 1
        if self.good_steps >= self.interval:
            self.scale *= 2.0
            self.good_steps = 0
        return True

    def describe(self) -> str:
        return (f"dynamic (start {self.scale:g}, x2 every {self.interval} good steps, "
                "/2 on overflow)")

    def state(self) -> dict:
        return {**super().state(), "interval": self.interval, "good_steps": self.good_steps}

    def load_state(self, state: dict) -> None:
        super().load_state(state)
        self.interval = int(state["interval"])
        self.good_steps = int(state["good_steps"])


def parse_loss_scale(spec: str | None, precision: str) -> LossScaler:
    """``None`` picks the default: dynamic for fp16/mixed, none for fp32."""
    if spec is None:
        spec = "none" if precision == "fp32" else "dynamic"
    text = spec.strip().lower()
    try:
        if text == "none":
            return LossScaler(1.0)
        if text.startswith("static:"):
            value = float(text.split(":", 1)[1])
            if not 0 < value <= MAX_SCALE:
                raise ValueError
            return LossScaler(value)
        if text == "dynamic" or text.startswith("dynamic:"):
            parts = text.split(":")[1:]
            init = float(parts[0]) if parts else DEFAULT_INIT
            interval = int(parts[1]) if len(parts) > 1 else DEFAULT_INTERVAL
            if not 0 < init <= MAX_SCALE or interval < 1 or len(parts) > 2:
                raise ValueError
            return DynamicLossScaler(init, interval)
    except ValueError:
        pass
    raise GraphoptError(f"bad --loss-scale {spec!r}; use none, static:N, dynamic or "
                        f"dynamic:INIT[:INTERVAL] (0 < N, INIT <= {MAX_SCALE:.4g}; INTERVAL >= 1)")

"""Learning-rate schedules with warmup, with the formulas of transformers'
``get_{constant,linear,cosine}_schedule_with_warmup`` (what HF Trainer users compare with):
the factor applied to ``--lr`` for the update of 0-based step ``step``:

* warmup (``step < warmup``): ``step / warmup``, from 0;
* ``constant``: 1;
* ``linear``: down to 0 at the last step, ``(total - step) / (total - warmup)``;
* ``cosine``: half a cosine from 1 to 0 over the steps after warmup.

The factor depends on the step alone, so a resumed run follows the same curve.
"""
from __future__ import annotations

import math

from graphopt.errors import GraphoptError

SCHEDULES = ("constant", "linear", "cosine")


def check_schedule(name: str, warmup: int, total: int) -> None:
    if name not in SCHEDULES:
        raise GraphoptError(f"unknown --lr-schedule {name!r}; choose one of "
                            f"{', '.join(SCHEDULES)}")
    if warmup < 0:
        raise GraphoptError(f"--warmup must be >= 0, not {warmup}")
    if warmup >= total and name != "constant":
        raise GraphoptError(f"--warmup {warmup} leaves no step of the {total} for the {name} "
                            "schedule to decay over")


def lr_factor(name: str, step: int, total: int, warmup: int = 0) -> float:
    if step < warmup:
        return step / max(1, warmup)
    if name == "constant":
        return 1.0
    progress = (step - warmup) / max(1, total - warmup)
    if name == "linear":
        return max(0.0, 1.0 - progress)
    return max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))


def clip_coefficient(norm: float, max_norm: float) -> float:
    """torch.nn.utils.clip_grad_norm_'s factor: gradients are scaled by it when it is < 1."""
    return min(1.0, max_norm / (norm + 1e-6))

"""Outputs of a run besides checkpoints: the trained model (written by :func:`save_model`;
:func:`graphopt.training.weights.with_weights` puts the weights in) and the loss-curve
plot."""
from __future__ import annotations

import os
from collections.abc import Sequence

import numpy as np
import onnx

from graphopt import modelio
from graphopt.errors import GraphoptError
from graphopt.ir import Model


def save_model(proto: onnx.ModelProto, path: str, *,
               protect: modelio.ProtectedFiles | None = None, what: str = "output",
               external: modelio.ExternalFiles | None = None) -> list[str]:
    """Atomic write (temporary file, fsync, rename); returns the files written. ``external``:
    the open files holding the bytes of ``proto``'s external tensors (the input model's), from
    which the save copies them (inline where the input held them inline)."""
    model = Model(proto)
    model.external = external
    try:
        return modelio.save(model, path, protect=protect, what=what)
    except OSError as exc:
        raise GraphoptError(f"{path}: cannot write: {exc.strerror or exc}") from None


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise GraphoptError("--plot needs matplotlib: pip install 'graphopt[examples]' "
                            "(or pip install matplotlib)") from None


PLOT_FORMATS = ("png", "svg", "pdf")
SMOOTHING = 0.9   # TensorBoard-style exponential moving average weight


def plot_format(path: str) -> str:
    """The file format --plot writes, from the file name's extension."""
    ext = os.path.splitext(path)[1].lower().lstrip(".")
    if ext not in PLOT_FORMATS:
        raise GraphoptError(f"--plot {path}: use a .png, .svg or .pdf file name (the format "
                            "follows the extension)")
    return ext


def smoothed(values: list[float], weight: float = SMOOTHING) -> list[float]:
    """Debiased exponential moving average (TensorBoard's smoothing), non-finite values
    skipped."""
    out, average, count = [], 0.0, 0
    for value in values:
        if np.isfinite(value):
            average = weight * average + (1.0 - weight) * value
            count += 1
        out.append(average / (1.0 - weight ** count) if count else float("nan"))
    return out


def plot_losses(history: Sequence[dict], path: str, title: str, *,
                protect: modelio.ProtectedFiles | None = None) -> None:
    """Raw training loss as faint points, its smoothed curve over them, the held-out loss
    where evaluated, and skipped steps in red (the history's rows: each step's, or each
    ``stride`` steps' of a long run); written in the extension's format, as every
    output is (:func:`graphopt.modelio.atomic_file`)."""
    fmt = plot_format(path)
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in history]
    losses = [r["loss"] for r in history]
    stride = history[0].get("steps", 1)   # a long run's rows each cover stride steps
    figure, axes = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    axes.plot(steps, losses, linestyle="none", marker=".", markersize=3, alpha=0.35,
              color="tab:blue", label="training loss (each step)" if stride == 1
              else f"training loss (mean of each {stride} steps)")
    axes.plot(steps, smoothed(losses), linewidth=1.5, color="tab:blue",
              label=f"training loss (smoothed, EMA {SMOOTHING:g})")
    evaluated = [r for r in history if r.get("eval_loss") is not None]
    if evaluated:
        axes.plot([r["step"] for r in evaluated], [r["eval_loss"] for r in evaluated],
                  marker="o", markersize=4, linewidth=1.2, color="tab:orange",
                  label="held-out loss")
    skipped = [r for r in history if not r.get("applied", True)]
    if skipped:
        axes.scatter([r["step"] for r in skipped], [r["loss"] for r in skipped], s=8,
                     color="red", label=f"skipped (overflow): {history[-1]['skipped']} steps",
                     zorder=3)
    axes.legend(fontsize=8)
    axes.set_xlabel("step")
    axes.set_ylabel("loss")
    axes.set_title(title, fontsize=9)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    try:
        with modelio.atomic_file(path, "--plot", protect=protect) as f:
            figure.savefig(f, format=fmt)
    finally:
        plt.close(figure)

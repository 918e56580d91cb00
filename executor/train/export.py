"""Outputs of a run besides checkpoints: the trained model and the loss-curve plot."""
from __future__ import annotations

import os

import numpy as np
import onnx
from onnx import numpy_helper

from graphopt import modelio
from graphopt.errors import GraphoptError
from graphopt.ir import Model


def trained_model(forward: onnx.ModelProto, params: dict[str, np.ndarray]) -> onnx.ModelProto:
    """The forward model as given (no YieldOp, no gradients) with the trained weights, each
    in its original dtype."""
    proto = onnx.ModelProto()
    proto.CopyFrom(forward)
    for index, tensor in enumerate(proto.graph.initializer):
        if tensor.name in params:
            dtype = numpy_helper.to_array(tensor).dtype
            replacement = numpy_helper.from_array(params[tensor.name].astype(dtype), tensor.name)
            proto.graph.initializer[index].CopyFrom(replacement)
    return proto


def save_model(proto: onnx.ModelProto, path: str) -> None:
    """Atomic write (temporary file, fsync, rename)."""
    try:
        modelio.save(Model(proto), path)
    except OSError as exc:
        raise GraphoptError(f"{path}: cannot write: {exc.strerror or exc}") from None


def require_matplotlib() -> None:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise GraphoptError("--plot needs matplotlib: pip install 'graphopt[examples]' "
                            "(or pip install matplotlib)") from None


def plot_losses(history: list[dict], path: str, title: str) -> None:
    require_matplotlib()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in history]
    losses = [r["loss"] for r in history]
    figure, axes = plt.subplots(figsize=(6.4, 4.0), dpi=100)
    axes.plot(steps, losses, linewidth=1.0)
    skipped = [r["step"] for r in history if not r.get("applied", True)]
    if skipped:
        axes.scatter(skipped, [losses[s - steps[0]] for s in skipped], s=8, color="red",
                     label=f"skipped (overflow): {len(skipped)}")
        axes.legend()
    axes.set_xlabel("step")
    axes.set_ylabel("training loss")
    axes.set_title(title)
    axes.grid(alpha=0.3)
    figure.tight_layout()
    tmp = f"{path}.tmp-{os.getpid()}.png"
    figure.savefig(tmp)
    plt.close(figure)
    os.replace(tmp, path)

"""Built-in examples for ``graphopt run --example NAME``: a model, its training data and
the training settings that make the example train visibly in about a minute on two CPU
cores.

    from graphopt.examples import load_example
    example = load_example("mqa")   # example.model, example.data, example.settings
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import onnx

from graphopt.errors import GraphoptError


@dataclass
class Example:
    name: str
    description: str
    model: onnx.ModelProto
    data: dict[str, np.ndarray]
    settings: dict = field(default_factory=dict)   # defaults for the run options


def _mqa() -> Example:
    from .mqa import MqaConfig, build_mqa_model
    from .text import char_dataset

    data, vocab = char_dataset(seq=MqaConfig.seq)
    cfg = MqaConfig(vocab=len(vocab))
    return Example(
        "mqa",
        f"Falcon-style multi-query attention character LM (vocab {cfg.vocab}, hidden "
        f"{cfg.hidden}, {cfg.heads} query heads + 1 shared key/value head, seq {cfg.seq}) "
        f"on {len(data['input_ids'])} windows of the bundled text",
        build_mqa_model(cfg), data,
        {"loss": "cross_entropy", "labels": "labels", "optimizer": "adamw", "lr": 3e-3,
         "batch_size": 32, "steps": 300})


def _mlp_digits() -> Example:
    from .digits import build_digits_mlp, digits_dataset

    data = digits_dataset()
    return Example(
        "mlp-digits",
        f"MLP 64-64-10 on scikit-learn's 8x8 digits ({len(data['x'])} images)",
        build_digits_mlp(), data,
        {"loss": "cross_entropy", "labels": "labels", "optimizer": "adamw", "lr": 3e-3,
         "batch_size": 64, "epochs": 10})


EXAMPLES: dict[str, Callable[[], Example]] = {"mqa": _mqa, "mlp-digits": _mlp_digits}


def load_example(name: str) -> Example:
    if name not in EXAMPLES:
        raise GraphoptError(f"unknown example {name!r}; choose one of {', '.join(EXAMPLES)}")
    return EXAMPLES[name]()

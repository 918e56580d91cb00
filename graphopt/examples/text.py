"""Next-character prediction data from ``corpus.txt`` (English prose written for this
project, public domain / MIT like the rest of the repository)."""
from __future__ import annotations

from importlib import resources

import numpy as np


def corpus() -> str:
    return resources.files(__package__).joinpath("corpus.txt").read_text(encoding="utf-8")


def char_dataset(seq: int, stride: int | None = None) -> tuple[dict[str, np.ndarray], str]:
    """({"input_ids": [n, seq], "labels": [n, seq]}, vocabulary): windows of ``seq``
    characters every ``stride`` (seq // 2) characters; labels are the next characters."""
    text = " ".join(corpus().split())  # one space for every run of white space
    vocab = "".join(sorted(set(text)))
    index = {c: i for i, c in enumerate(vocab)}
    codes = np.array([index[c] for c in text], np.int64)
    stride = stride or seq // 2
    starts = np.arange(0, len(codes) - seq - 1, stride)
    windows = np.stack([codes[s:s + seq + 1] for s in starts])
    return {"input_ids": windows[:, :-1].copy(), "labels": windows[:, 1:].copy()}, vocab

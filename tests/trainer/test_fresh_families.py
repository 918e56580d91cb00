"""Fresh Hugging Face models of nine families, each exported by both PyTorch exporters:
`graphopt run`'s defaults train exactly PyTorch's ``named_parameters()`` (each one found among
the trained tensors by name, module path or value: exporters rename, transpose, tie, merge),
and 5 SGD steps give PyTorch's losses.

The truth is tests/fixtures/make_family_fixtures.py's. A fresh model is what the exporters
rewrite most (all-ones norms and all-zero biases merged, tied embeddings folded into a
transposed copy, rotary tables and position ids kept as initializers)."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
from support.training_runs import FIXTURES, write_npz

from graphopt.modelio import tensor_value
from graphopt.trainer import RunOptions, run
from graphopt.training.module_paths import module_paths

FAMILIES = ["llama", "mistral", "qwen2", "gptj", "falcon", "gpt2", "bert", "vit", "t5"]
EXPORTERS = ["ts17", "dynamo18"]


def _truth(family: str):
    data = np.load(os.path.join(FIXTURES, f"family_{family}.npz"))
    return data, json.loads(str(data["__meta__"]))


def _fingerprint(value: np.ndarray) -> tuple[float, float]:
    value = value.astype(np.float64)
    return float(value.sum()), float((value * value).sum())


def _close(a, b) -> bool:
    return all(np.isclose(x, y, rtol=1e-6, atol=1e-6) for x, y in zip(a, b, strict=True))


@pytest.fixture(scope="module", params=[(f, e) for f in FAMILIES for e in EXPORTERS],
                ids=lambda p: f"{p[0]}-{p[1]}")
def trained(request, tmp_path_factory):
    family, exporter = request.param
    data, meta = _truth(family)
    if exporter in meta["failed"]:
        pytest.skip(f"the {exporter} export of {family} failed: {meta['failed'][exporter]}")
    folder = tmp_path_factory.mktemp(f"{family}-{exporter}")
    arrays = {name: data[name] for name in [*meta["inputs"], "labels"]}
    outcome = run(RunOptions(
        model=os.path.join(FIXTURES, f"family_{family}_{exporter}.onnx"),
        data=write_npz(folder / "batch.npz", arrays), loss="cross_entropy",
        steps=meta["train_steps"], batch_size=len(data["labels"]), optimizer="sgd",
        lr=meta["train_lr"], weight_decay=0.0, seed=0, device="cpu", quiet=True))
    return family, exporter, data, meta, outcome


def test_the_default_trained_set_is_pytorchs_named_parameters(trained):
    family, exporter, _, meta, outcome = trained
    graph, forward = outcome.graph, outcome.forward
    values = {t.name: tensor_value(t, outcome.external) for t in forward.graph.initializer}
    paths = module_paths(forward)
    trained_names = list(graph.params)
    unmatched = list(trained_names)
    missing = []
    by_value = []
    for param in meta["params"]:   # by name (or module path) first, then by value
        wanted = "inner." + param["name"]
        found = [n for n in unmatched if wanted in (n, paths.get(n))]
        if found:
            unmatched.remove(found[0])
        else:
            by_value.append(param)
    for param in by_value:
        found = [n for n in unmatched if sorted(values[n].shape) == sorted(param["shape"])
                 and _close(_fingerprint(values[n]), param["fingerprint"])]
        if found:
            unmatched.remove(found[0])
        else:
            missing.append(param["name"])
    assert not missing, f"{family} {exporter}: PyTorch trains {missing}, graphopt does not"
    assert not unmatched, f"{family} {exporter}: graphopt trains {unmatched}, PyTorch does not"
    assert len(trained_names) == len(meta["params"])


def test_five_sgd_steps_give_pytorchs_losses(trained):
    family, exporter, data, _, outcome = trained
    np.testing.assert_allclose(outcome.result.losses, data["torch_losses"], rtol=1e-5,
                               atol=1e-5, err_msg=f"{family} {exporter}")

"""An embedding's padding row (nn.Embedding(padding_idx)) gets no gradient from its lookups,
while a tied output projection still trains it, as autograd does: found in a dynamo export's
metadata, named with --padding-idx for a TorchScript one (which drops it).

The truth is tests/fixtures/make_padding_fixtures.py's: a tiny tied language model trained by
torch.optim.SGD on sequences holding padding tokens."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest
from support.cli_runs import assert_one_error_line, cli
from support.training_runs import FIXTURES, in_epoch_order, write_npz

from graphopt.trainer import RunOptions, run

TRUTH = np.load(os.path.join(FIXTURES, "padded_lm_truth.npz"))
META = json.loads(str(TRUTH["__meta__"]))
SEED = 5
# the exports' names of the embedding and of mix.weight (TorchScript folds it transposed)
EXPORTS = {"padded_lm_dynamo18.onnx": ("head.weight", None),
           "padded_lm_ts17.onnx": ("embed.weight", "onnx::MatMul_11")}


def _data(tmp_path) -> str:
    arrays = {"input_ids": TRUTH["input_ids"], "labels": TRUTH["labels"]}
    return write_npz(tmp_path / "tokens.npz", in_epoch_order(arrays, META["batch_size"], SEED))


def _train(tmp_path, model: str, **options):
    return run(RunOptions(model=os.path.join(FIXTURES, model), data=_data(tmp_path),
                          loss="cross_entropy", steps=META["steps"],
                          batch_size=META["batch_size"], optimizer="sgd", lr=META["lr"],
                          seed=SEED, device="cpu", quiet=True, **options)).result


@pytest.mark.parametrize("model", list(EXPORTS))
def test_the_padding_row_trains_as_in_pytorch(tmp_path, model):
    embedding, mix = EXPORTS[model]
    given = {"padding_idx": META["padding_idx"]} if "ts17" in model else {}
    result = _train(tmp_path, model, **given)
    np.testing.assert_allclose(result.losses, TRUTH["losses"], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(result.params[embedding], TRUTH["final/embed.weight"],
                               rtol=1e-5, atol=1e-6)
    if mix is not None:
        np.testing.assert_allclose(result.params[mix], TRUTH["final/mix.weight"].T,
                                   rtol=1e-5, atol=1e-6)
    # the tied projection moved the padding row: masking the summed gradient would not
    pad = META["padding_idx"]
    assert not np.allclose(TRUTH["final/embed.weight"][pad], 0.0)


def test_without_the_padding_index_the_lookups_train_the_row(tmp_path):
    """What a TorchScript export trains when not told: the lookups' gradient reaches the
    padding row, and the run leaves PyTorch's path."""
    result = _train(tmp_path, "padded_lm_ts17.onnx")
    assert not np.allclose(result.params["embed.weight"][META["padding_idx"]],
                           TRUTH["final/embed.weight"][META["padding_idx"]], atol=1e-4)


@pytest.mark.parametrize("model,args,how", [
    ("padded_lm_dynamo18.onnx", (), "as the dynamo export records it"),
    ("padded_lm_ts17.onnx", ("--padding-idx", "0"), "--padding-idx"),
])
def test_the_listing_names_the_padding_row(model, args, how):
    code, out, err = cli("run", os.path.join(FIXTURES, model), "--loss", "cross_entropy",
                         "--list-params", *args)
    assert code == 0, err
    line = next(line for line in out.splitlines() if line.startswith("padding rows:"))
    assert "row 0" in line and how in line


@pytest.mark.parametrize("value,words", [("64", "has 64 rows"), ("-1", "has 64 rows")])
def test_a_padding_index_outside_the_embedding_is_one_line(tmp_path, value, words):
    code, _, err = cli("run", os.path.join(FIXTURES, "padded_lm_ts17.onnx"), "--data",
                       _data(tmp_path), "--loss", "cross_entropy", "--padding-idx", value)
    assert_one_error_line(code, err, words)


def test_a_model_without_token_lookups_refuses_a_padding_index(tmp_path):
    rng = np.random.default_rng(0)
    data = write_npz(tmp_path / "d.npz", {"x": rng.standard_normal((8, 64)).astype(np.float32),
                                          "labels": rng.integers(0, 10, 8)})
    code, _, err = cli("run", os.path.join(FIXTURES, "mlp.onnx"), "--data", data, "--loss",
                       "cross_entropy", "--batch-size", "4", "--padding-idx", "0")
    assert_one_error_line(code, err, "no embedding lookup")

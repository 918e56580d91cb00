"""`optimize --check` draws inputs a real run would see: symbolic dimensions above 1, token
ids across the embedding they index (not only 0 and 1, which leave a decoder's attention and
most of its vocabulary untested), a Dropout's training_mode False; and it prints them."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from support.cli_runs import cli
from support.models import model_from_text

from graphopt.executor import compare


def _embedding_model() -> onnx.ModelProto:
    values = ", ".join(str(v) for v in np.arange(400) / 100)
    text = """
<ir_version: 8, opset_import: ["" : 17]>
g (int64[batch, seq] ids) => (float[batch, seq, 8] y) <float[50, 8] table = {VALUES},
                                                      int64[1] flat_shape = {-1},
                                                      int64[1] eight = {8}> {
  flat = Reshape(ids, flat_shape)
  rows = Gather <axis = 0> (table, flat)
  ids_shape = Shape(ids)
  out_shape = Concat <axis = 0> (ids_shape, eight)
  y = Reshape(rows, out_shape)
}
"""
    return model_from_text(text.replace("VALUES", values))


def test_token_ids_cover_the_embedding_and_symbolic_dims_are_above_one():
    model = _embedding_model()
    feeds = compare.random_inputs(model, np.random.default_rng(0))
    ids = feeds["ids"]
    assert ids.shape == (compare.SYMBOLIC_DIM, compare.SYMBOLIC_DIM) and compare.SYMBOLIC_DIM > 1
    assert 2 < ids.max() < 50 and ids.min() >= 0
    described = compare.describe_inputs(model)
    assert "ids [4, 4] int64 in [0, 50) (Gather indices)" in described


def test_input_shape_still_sets_the_dims():
    feeds = compare.random_inputs(_embedding_model(), np.random.default_rng(0), {"ids": [2, 7]})
    assert feeds["ids"].shape == (2, 7)


DROPOUT = """
<ir_version: 8, opset_import: ["" : 17]>
g (float[N, 16] x, bool training) => (float[N, 16] y) <float ratio = {0.5}> {
  d = Dropout(x, ratio, training)
  y = Relu(d)
}
"""


def test_a_dropout_runs_in_inference_mode_and_the_check_passes(tmp_path):
    source = tmp_path / "dropout.onnx"
    onnx.save(model_from_text(DROPOUT), source)
    feeds = compare.random_inputs(onnx.load(source), np.random.default_rng(0))
    assert feeds["training"].dtype == np.bool_ and not feeds["training"].any()
    code, out, err = cli("optimize", source, "-o", tmp_path / "out.onnx", "--check", "3")
    assert code == 0, err
    assert "outputs match" in out
    assert "training [] bool False (Dropout in inference mode)" in out


@pytest.mark.parametrize("shape_args,expected", [
    ((), "ids [4, 4] int64 in [0, 50) (Gather indices)"),
    (("--input-shape", "ids:2,3"), "ids [2, 3] int64 in [0, 50) (Gather indices)"),
])
def test_the_check_prints_the_inputs_it_drew(tmp_path, shape_args, expected):
    source = tmp_path / "embedding.onnx"
    onnx.save(_embedding_model(), source)
    code, out, err = cli("optimize", source, "-o", tmp_path / "out.onnx", "--check", "1",
                         *shape_args)
    assert code == 0, err
    assert f"check inputs: {expected}" in out

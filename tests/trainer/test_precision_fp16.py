"""`--precision fp16`: the master weights themselves are float16, so every update is rounded
to float16 and an update under half a float16 ulp of its weight is lost; `mixed` keeps
float32 master weights and does not lose it. The trained model is still written in float32,
loadable by onnxruntime."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from support.training_runs import MLP, mlp_data, write_npz

from graphopt.trainer import RunOptions, run


def train(tmp_path, precision, **options):
    data = write_npz(tmp_path / "d.npz", mlp_data())
    settings = dict(model=MLP, data=data, loss="cross_entropy", batch_size=4, device="cpu",
                    optimizer="sgd", loss_scale="static:1", precision=precision, quiet=True)
    settings.update(options)
    return run(RunOptions(**settings))


def initial_weights():
    return {t.name: onnx.numpy_helper.to_array(t).astype(np.float32)
            for t in onnx.load(MLP).graph.initializer}


def test_fp16_trains_with_weights_on_the_float16_grid(tmp_path):
    outcome = train(tmp_path, "fp16", steps=30, lr=0.05)
    losses = outcome.result.losses
    assert len(losses) == 30 and all(np.isfinite(losses))
    assert np.mean(losses[-5:]) < np.mean(losses[:5])
    for name, weight in outcome.result.params.items():
        as_half = weight.astype(np.float16).astype(np.float32)
        np.testing.assert_array_equal(weight, as_half, err_msg=name)


def test_updates_below_half_an_ulp_vanish_in_fp16_but_not_in_mixed(tmp_path):
    # lr 1e-6: a step moves a weight by far less than half the float16 spacing of any weight
    # of size >= 0.01 (>= 3.8e-6), so float16 master weights of that size cannot move at all;
    # float32 master weights (mixed) do.
    start = initial_weights()
    fp16 = train(tmp_path, "fp16", steps=5, lr=1e-6).result.params
    mixed = train(tmp_path, "mixed", steps=5, lr=1e-6).result.params
    big = [name for name, w in start.items() if w.ndim == 2]  # the two Gemm weights
    assert big
    for name in big:
        sizable = np.abs(start[name]) >= 1e-2
        as_half = start[name].astype(np.float16).astype(np.float32)
        np.testing.assert_array_equal(fp16[name][sizable], as_half[sizable], err_msg=name)
        assert (mixed[name][sizable] != start[name][sizable]).mean() > 0.5, name


def test_fp16_run_writes_a_float32_model_that_onnxruntime_runs(tmp_path):
    ort = pytest.importorskip("onnxruntime")
    out = str(tmp_path / "trained.onnx")
    outcome = train(tmp_path, "fp16", steps=5, lr=0.05, output=out)
    trained = onnx.load(out)
    onnx.checker.check_model(trained, full_check=True)
    weights = {t.name: onnx.numpy_helper.to_array(t) for t in trained.graph.initializer}
    for name, value in outcome.result.params.items():
        assert weights[name].dtype == np.float32
        np.testing.assert_array_equal(weights[name], value)
    x = mlp_data()["x"][:4]
    session = ort.InferenceSession(out, providers=["CPUExecutionProvider"])
    (logits,) = session.run(None, {"x": x})
    assert logits.shape == (4, 10) and np.isfinite(logits).all()

"""graphopt against PyTorch, without PyTorch: the committed results of
tests/fixtures/make_torch_truth.py (optimizer trajectories, whole training runs of the MLP
fixture, dynamic loss scaling with overflows) are what graphopt must reproduce.
(tests/trainer/test_torch_parity.py runs torch itself, for those who have it.)"""
from __future__ import annotations

import json
import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from support.training_runs import FIXTURES, MLP, in_epoch_order, write_npz

from graphopt.trainer import RunOptions, run
from graphopt.trainer.optimizers import make_optimizer


def _load(name: str):
    data = np.load(os.path.join(FIXTURES, name))
    return data, json.loads(str(data["__meta__"]))


OPTIMIZERS, OPT_META = _load("torch_optimizers.npz")
TRAINING, TRAIN_META = _load("torch_training.npz")


# ---- one optimizer, a fixed gradient sequence ----------------------------------------------
@pytest.mark.parametrize("config", list(OPT_META["configs"]))
def test_optimizer_updates_follow_pytorch_step_by_step(config):
    spec = OPT_META["configs"][config]
    # a bare torch.optim optimizer decays every tensor
    opt = make_optimizer(spec["optimizer"], spec["lr"], spec["weight_decay"], decay_all=True)
    params = {name: OPTIMIZERS[f"initial/{name}"].copy() for name in ("w", "b")}
    for t in range(OPT_META["steps"]):
        opt.step(params, {name: OPTIMIZERS[f"grads/{name}"][t] for name in params})
        for name, value in params.items():
            np.testing.assert_allclose(value, OPTIMIZERS[f"{config}/{name}/steps"][t],
                                       rtol=2e-6, atol=2e-7, err_msg=f"{config} {name} step {t}")


# ---- the MLP fixture trained end to end -----------------------------------------------------
@pytest.mark.parametrize("config", list(TRAIN_META["mlp"]["configs"]))
def test_mlp_losses_and_weights_match_pytorch(tmp_path, config):
    meta = TRAIN_META["mlp"]
    spec = meta["configs"][config]
    data = in_epoch_order({"x": TRAINING["mlp/x"], "labels": TRAINING["mlp/labels"]},
                              meta["batch_size"], seed=3)
    outcome = run(RunOptions(model=MLP, data=write_npz(tmp_path / "d.npz", data),
                             loss=meta["loss"], steps=meta["steps"],
                             batch_size=meta["batch_size"], optimizer=spec["optimizer"],
                             lr=spec["lr"], weight_decay=spec["weight_decay"],
                             weight_decay_all=spec.get("decay_all", True), seed=3,
                             device="cpu", quiet=True))
    np.testing.assert_allclose(outcome.result.losses, TRAINING[f"mlp/{config}/losses"],
                               rtol=1e-6, atol=2e-6)
    for name in meta["params"]:
        np.testing.assert_allclose(outcome.result.params[name], TRAINING[f"mlp/{config}/{name}"],
                                   rtol=1e-5, atol=1e-6, err_msg=name)


# ---- dynamic loss scaling with overflows ----------------------------------------------------
def _dot_loss_model(path) -> str:
    """loss = sum(x * p): the gradient of p is the batch row itself."""
    p0 = TRAINING["scaling/p0"]
    graph = helper.make_graph(
        [helper.make_node("Mul", ["x", "p"], ["xp"]),
         helper.make_node("ReduceSum", ["xp"], ["loss"], keepdims=0)], "dot",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        initializer=[numpy_helper.from_array(p0, "p")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return str(path)


@pytest.mark.parametrize("optimizer", TRAIN_META["scaling"]["optimizers"])
def test_dynamic_loss_scaling_matches_pytorch_gradscaler(tmp_path, optimizer):
    """Scale used, steps skipped on overflow, back-off and growth, and the updates, step for
    step against torch.amp.GradScaler: SGD sees whether the gradients were unscaled, AdamW
    whether a skipped step counted for its bias correction."""
    meta = TRAIN_META["scaling"]
    truth = {k: TRAINING[f"scaling/{optimizer}/{k}"] for k in ("scales", "applied", "params")}
    data = in_epoch_order({"x": TRAINING["scaling/x"]}, 1, seed=5)
    outcome = run(RunOptions(model=_dot_loss_model(tmp_path / "dot.onnx"),
                             data=write_npz(tmp_path / "d.npz", data), loss="loss",
                             steps=meta["steps"], batch_size=1, optimizer=optimizer,
                             lr=meta["lr"], weight_decay=0.0, seed=5, device="cpu", quiet=True,
                             loss_scale=f"dynamic:{meta['init']:g}:{meta['interval']}"))
    history = outcome.result.history
    assert [r["loss_scale"] for r in history] == truth["scales"].tolist()
    assert [r["applied"] for r in history] == truth["applied"].tolist()
    assert outcome.result.skipped == len(meta["overflow_steps"])
    np.testing.assert_allclose(outcome.result.params["p"], truth["params"][-1],
                               rtol=1e-6, atol=1e-7)

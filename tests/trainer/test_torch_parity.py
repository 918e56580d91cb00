"""Loss after N steps equals a PyTorch training run of the same model: same initial weights
(the fixture's), same batches in the same order, same optimizer and hyper-parameters."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper
from support.training_runs import MLP, mlp_data, write_npz

from graphopt.trainer import RunOptions, run
from graphopt.trainer.data import Batches

torch = pytest.importorskip("torch")
STEPS, BATCH, SEED = 25, 4, 3


def torch_losses(optimizer_name: str, lr: float, weight_decay: float, data) -> tuple[list, dict]:
    weights = {t.name: torch.tensor(numpy_helper.to_array(t).copy())
               for t in onnx.load(MLP).graph.initializer}
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU(), torch.nn.Linear(32, 10))
    with torch.no_grad():
        for name, param in zip(["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"],
                               model.parameters(), strict=True):
            param.copy_(weights[name])
    if optimizer_name == "sgd":
        opt = torch.optim.SGD(model.parameters(), lr=lr, weight_decay=weight_decay)
    elif optimizer_name == "momentum":
        opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=weight_decay)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    batches = Batches(data, ["x", "labels"], BATCH, SEED)  # the same order graphopt uses
    losses = []
    for step in range(STEPS):
        batch = batches.batch(step)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(torch.from_numpy(batch["x"])),
                                                 torch.from_numpy(batch["labels"]))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    names = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    return losses, {n: p.detach().numpy() for n, p in zip(names, model.parameters(), strict=True)}


@pytest.mark.parametrize("optimizer,lr,weight_decay", [
    ("sgd", 0.1, 0.0), ("sgd", 0.05, 0.01), ("momentum", 0.05, 0.001), ("adamw", 0.01, 0.01),
])
def test_losses_and_weights_match_pytorch(tmp_path, optimizer, lr, weight_decay):
    data = mlp_data()
    outcome = run(RunOptions(model=MLP, data=write_npz(tmp_path / "d.npz", data),
                             loss="cross_entropy", steps=STEPS, batch_size=BATCH,
                             optimizer=optimizer, lr=lr, weight_decay=weight_decay, seed=SEED,
                             device="cpu", quiet=True))
    expected_losses, expected_weights = torch_losses(optimizer, lr, weight_decay, data)
    ours = outcome.result.losses
    assert ours[-1] < ours[0] - 0.1  # it trained at all
    np.testing.assert_allclose(ours, expected_losses, rtol=2e-4, atol=2e-5)
    for name, value in expected_weights.items():
        np.testing.assert_allclose(outcome.result.params[name], value, rtol=1e-3, atol=1e-5,
                                   err_msg=name)

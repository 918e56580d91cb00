"""Loss scaling changes nothing but the range the gradients travel in: they are divided by
the scale before the optimizer sees them, so with SGD (which, unlike Adam, is not invariant
to the size of the gradient) a scaled fp32 run ends on the weights of an unscaled one."""
from __future__ import annotations

import numpy as np
import pytest
from support.training_runs import MLP, mlp_data, write_npz

from graphopt.trainer import RunOptions, run
from graphopt.trainer.loss_scaling import DynamicLossScaler


@pytest.mark.parametrize("loss_scale", ["static:1024", "dynamic:256:2"])
def test_gradients_are_unscaled_before_the_optimizer_step(tmp_path, loss_scale):
    data = write_npz(tmp_path / "d.npz", mlp_data())
    common = dict(model=MLP, data=data, loss="cross_entropy", steps=6, batch_size=4,
                  optimizer="sgd", lr=0.1, seed=2, device="cpu", quiet=True, precision="fp32")
    plain = run(RunOptions(**common, loss_scale="none")).result
    scaled = run(RunOptions(**common, loss_scale=loss_scale)).result
    assert scaled.skipped == 0
    assert {r["loss_scale"] for r in scaled.history} != {1.0}
    np.testing.assert_allclose(scaled.losses, plain.losses, rtol=1e-6)
    for name, value in plain.params.items():
        # powers of two: scaling and unscaling are exact in float32
        np.testing.assert_allclose(scaled.params[name], value, rtol=1e-6, atol=1e-8,
                                   err_msg=name)


def test_back_off_stops_at_a_scale_of_1():
    """Below 1 scaling would push small gradients further into the FP16 subnormals."""
    scaler = DynamicLossScaler(init=4.0, interval=100)
    assert [scaler.update(True) or scaler.scale for _ in range(4)] == [2.0, 1.0, 1.0, 1.0]
    assert scaler.skipped == 4

"""Small parts of the loop: loss-scaler dynamics, data order, precision conversion,
optimizer state round trip."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from support.training_runs import MLP

from graphopt.errors import GraphoptError
from graphopt.trainer.data import Batches
from graphopt.trainer.loss_scaling import DynamicLossScaler, parse_loss_scale
from graphopt.trainer.optimizers import make_optimizer
from graphopt.training.float16 import to_float16


def test_dynamic_scaler_grows_backs_off_and_counts_skips():
    scaler = DynamicLossScaler(init=8.0, interval=2)
    outcomes = [scaler.update(o) for o in (False, False, True, False, True, True)]
    assert outcomes == [True, True, False, True, False, False]
    assert scaler.skipped == 3
    # 8 -> 16 after two good steps -> 8 -> (one good) -> 4 -> 2
    assert scaler.scale == 2.0
    twin = DynamicLossScaler()
    twin.load_state(scaler.state())
    assert (twin.scale, twin.skipped, twin.interval, twin.good_steps) == (2.0, 3, 2, 0)


@pytest.mark.parametrize("spec,scale", [("none", 1.0), ("static:128", 128.0),
                                        ("dynamic", 65536.0), ("dynamic:4:10", 4.0)])
def test_loss_scale_specs(spec, scale):
    assert parse_loss_scale(spec, "mixed").scale == scale


@pytest.mark.parametrize("spec", ["static:0", "static:x", "dynamic:1:0", "auto", "dynamic:1:2:3"])
def test_bad_loss_scale_specs(spec):
    with pytest.raises(GraphoptError, match="--loss-scale"):
        parse_loss_scale(spec, "mixed")


def test_defaults_dynamic_for_fp16_none_for_fp32():
    assert parse_loss_scale(None, "fp32").scale == 1.0
    assert parse_loss_scale(None, "mixed").dynamic


def test_batches_are_a_function_of_seed_and_step():
    data = {"x": np.arange(10), "y": np.arange(10) * 2}
    a, b = Batches(data, ["x", "y"], 3, seed=1), Batches(data, ["x", "y"], 3, seed=1)
    assert a.steps_per_epoch == 3  # the partial batch is dropped
    epoch0 = np.concatenate([a.batch(s)["x"] for s in range(3)])
    assert len(set(epoch0)) == 9  # no repeats within an epoch
    assert not np.array_equal(epoch0, np.concatenate([a.batch(s)["x"] for s in range(3, 6)]))
    for step in (5, 0, 4):  # any order, same answer
        np.testing.assert_array_equal(a.batch(step)["x"], b.batch(step)["x"])
        np.testing.assert_array_equal(a.batch(step)["y"], a.batch(step)["x"] * 2)
    other = Batches(data, ["x", "y"], 3, seed=2)
    assert not np.array_equal(other.batch(0)["x"], a.batch(0)["x"])


def test_float16_conversion_keeps_the_output_in_float32():
    half = to_float16(onnx.load(MLP))
    assert {t.data_type for t in half.graph.initializer} == {onnx.TensorProto.FLOAT16}
    assert half.graph.input[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT16
    assert half.graph.output[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT
    assert half.graph.node[-1].op_type == "Cast" and half.graph.node[-1].output[0] == "output"
    onnx.checker.check_model(half, full_check=True)


def test_optimizer_state_round_trip_is_exact():
    rng = np.random.default_rng(0)
    params = {"w": rng.standard_normal(5).astype(np.float32)}
    first, second = make_optimizer("adamw", 0.1), make_optimizer("adamw", 0.1)
    for _ in range(3):
        first.step(params, {"w": rng.standard_normal(5).astype(np.float32)})
    second.load_state(*first.state())
    grad = {"w": np.ones(5, np.float32)}
    a, b = {"w": params["w"].copy()}, {"w": params["w"].copy()}
    first.step(a, grad)
    second.step(b, grad)
    np.testing.assert_array_equal(a["w"], b["w"])
    with pytest.raises(GraphoptError, match="lr"):
        make_optimizer("adamw", 0.2).load_state(*first.state())


def test_each_optimizer_checks_its_own_checkpoint_scalars():
    """A new optimizer with a boolean hyperparameter declares it; checkpoint code is not
    touched (checkpoint validation asks the optimizer's class)."""
    from graphopt.trainer.optimizers import SGD

    class Nesterov(SGD):
        name = "nesterov"
        scalar_kinds = {**SGD.scalar_kinds, "nesterov": "bool"}

    good = {"name": "nesterov", "steps": 2, "lr": 0.1, "weight_decay": 0.0,
            "decay_all": False, "nesterov": True}
    assert Nesterov.scalars_problem(good) is None
    assert "nesterov is 'yes', not true/false" in Nesterov.scalars_problem(
        {**good, "nesterov": "yes"})
    assert "no scalar of sgd" in SGD.scalars_problem(good)
    assert "lr is 0, not a finite number > 0" in SGD.scalars_problem({"lr": 0})
    assert SGD.scalars_problem(make_optimizer("sgd", 0.1).state()[0]) is None
    assert make_optimizer("adamw", 0.1).scalars_problem(
        make_optimizer("adamw", 0.1).state()[0]) is None

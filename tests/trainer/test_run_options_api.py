"""A RunOptions made in Python is checked as the command line checks its options: a field
holding the wrong kind of value is one GraphoptError naming the option, before anything is
loaded; paths may be os.PathLike."""
from __future__ import annotations

import pathlib

import pytest
from support.training_runs import MLP, mlp_data, write_npz

from graphopt.errors import GraphoptError
from graphopt.trainer import RunOptions, run
from graphopt.trainer.options import checked


def base(tmp_path, **overrides) -> RunOptions:
    fields = dict(model=MLP, data=write_npz(tmp_path / "d.npz", mlp_data()),
                  loss="cross_entropy", steps=2, batch_size=4, device="cpu", quiet=True)
    return RunOptions(**{**fields, **overrides})


WRONG = {
    "steps as text": (dict(steps="2"), "--steps (RunOptions.steps) is '2', not an integer"),
    "fractional steps": (dict(steps=1.5), "not an integer"),
    "steps true": (dict(steps=True), "not an integer"),
    "lr as text": (dict(lr="fast"), "--lr (RunOptions.lr) is 'fast', not a number"),
    "weight decay as a list": (dict(weight_decay=[0.1]), "not a number"),
    "data as a number": (dict(data=42), "--data (RunOptions.data) is 42, not text"),
    "output as bytes": (dict(output=b"t.onnx"), "not text"),
    "loss as a number": (dict(loss=5), "--loss (RunOptions.loss) is 5, not text"),
    "loss scale as a number": (dict(loss_scale=2.0), "--loss-scale"),
    "an unknown optimizer": (dict(optimizer="lion"), "not one of sgd, momentum, adamw"),
    "freeze as one text": (dict(freeze="fc1.weight"), "not a list of names"),
    "train holding numbers": (dict(train=[1, 2]), "not a list of names"),
    "disable None": (dict(disable=None), "--disable (RunOptions.disable) is None"),
    "quiet as text": (dict(quiet="yes"), "not True or False"),
    "checkpoint_every 0": (dict(checkpoint_every=0), "--checkpoint-every must be an integer >= 1"),
    "history_rows 1": (dict(history_rows=1), "--history-rows must be an integer from 2 to 65536"),
    "seed beyond 32 bits": (dict(seed=2**32), "--seed must be an integer from 0 to 4294967295"),
}


@pytest.mark.parametrize("case", list(WRONG))
def test_a_field_of_the_wrong_kind_is_one_error_naming_its_option(tmp_path, case):
    overrides, message = WRONG[case]
    with pytest.raises(GraphoptError, match=None) as caught:
        run(base(tmp_path, **overrides))
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_paths_may_be_path_objects(tmp_path):
    opts = base(tmp_path, data=pathlib.Path(tmp_path / "d.npz"), output=tmp_path / "t.onnx")
    assert checked(opts).data == str(tmp_path / "d.npz")
    outcome = run(opts)
    assert outcome.result.steps_done == 2 and (tmp_path / "t.onnx").exists()


def test_the_defaults_pass_unchanged():
    opts = RunOptions()
    assert checked(opts) is opts

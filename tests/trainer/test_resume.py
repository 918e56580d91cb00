"""An interrupted run resumed from its checkpoint ends on exactly the weights of the
uninterrupted run: mid-epoch, across epoch boundaries, with optimizer and loss-scaler state,
through the real Ctrl-C path (SIGINT to this process)."""
from __future__ import annotations

import os
import signal

import numpy as np
import pytest
from support.training_runs import MLP, mlp_data, wide_matmul, write_npz

from graphopt.errors import GraphoptError
from graphopt.trainer import RunOptions, run
from graphopt.trainer import checkpoint as ckpt


def options(tmp_path, **overrides) -> RunOptions:
    base = dict(model=MLP, data=write_npz(tmp_path / "d.npz", mlp_data(samples=42)),
                loss="cross_entropy", steps=27, batch_size=4, optimizer="adamw", lr=0.01,
                seed=5, device="cpu", quiet=True)
    return RunOptions(**{**base, **overrides})


def interrupt_at(stop_step):
    def after_step(step, record):
        if step == stop_step:
            os.kill(os.getpid(), signal.SIGINT)  # what Ctrl-C does; the loop finishes the step
    return after_step


@pytest.mark.parametrize("stop_step", [7, 10, 13])  # mid-epoch, epoch end (10/epoch), next epoch
@pytest.mark.parametrize("optimizer,precision,loss_scale", [
    ("adamw", "fp32", None), ("momentum", "fp32", None), ("adamw", "mixed", "dynamic:1024:3"),
])
def test_ctrl_c_then_resume_equals_uninterrupted(tmp_path, stop_step, optimizer, precision,
                                                 loss_scale):
    common = dict(optimizer=optimizer, precision=precision, loss_scale=loss_scale)
    straight = run(options(tmp_path, **common))
    folder = str(tmp_path / "ckpt")
    first = run(options(tmp_path, checkpoint=folder, **common), after_step=interrupt_at(stop_step))
    assert first.result.interrupted and first.result.steps_done == stop_step
    assert ckpt.load(folder).step == stop_step
    resumed = run(options(tmp_path, checkpoint=folder, resume=True, **common))
    assert resumed.result.steps_done == 27 and not resumed.result.interrupted
    for name, value in straight.result.params.items():
        np.testing.assert_array_equal(resumed.result.params[name], value, err_msg=name)
    assert resumed.result.losses == straight.result.losses  # the history carries over
    assert resumed.result.skipped == straight.result.skipped
    if loss_scale:  # the scaler really moved: overflow skips, then x2 after 3 good steps
        scales = [r["loss_scale"] for r in straight.result.history]
        assert straight.result.skipped > 0 and max(scales[1:]) > min(scales)


def test_resume_can_extend_a_finished_run(tmp_path):
    folder = str(tmp_path / "ckpt")
    run(options(tmp_path, steps=12, checkpoint=folder))
    extended = run(options(tmp_path, steps=27, checkpoint=folder, resume=True))
    straight = run(options(tmp_path, steps=27))
    for name, value in straight.result.params.items():
        np.testing.assert_array_equal(extended.result.params[name], value)


def test_checkpoint_every_n_steps_and_no_temp_files_left(tmp_path):
    folder = tmp_path / "ckpt"
    seen = []
    run(options(tmp_path, steps=9, checkpoint=str(folder), checkpoint_every=4),
        after_step=lambda step, _: seen.append(ckpt.load(str(folder)).step
                                               if (folder / ckpt.FILENAME).exists() else None))
    assert seen == [None, None, None, None, 4, 4, 4, 4, 8]  # read before step N's own save
    assert sorted(os.listdir(folder)) == [ckpt.FILENAME]
    assert ckpt.load(str(folder)).step == 9


@pytest.mark.parametrize("change,message", [
    (dict(seed=6), "seed"), (dict(lr=0.02), "lr"), (dict(optimizer="sgd"), "optimizer"),
    (dict(precision="mixed"), "precision"), (dict(data="other"), "size"),
])
def test_resume_refuses_a_different_run(tmp_path, change, message):
    folder = str(tmp_path / "ckpt")
    run(options(tmp_path, steps=3, checkpoint=folder))
    if change.get("data") == "other":
        change["data"] = write_npz(tmp_path / "other.npz", mlp_data(samples=50))
    with pytest.raises(GraphoptError, match=message):
        run(options(tmp_path, checkpoint=folder, resume=True, **change))


def test_resume_without_checkpoint_is_an_error(tmp_path):
    with pytest.raises(GraphoptError, match="no checkpoint"):
        run(options(tmp_path, checkpoint=str(tmp_path / "empty"), resume=True))


def test_a_resume_on_another_blas_thread_count_still_ends_on_the_same_bits(tmp_path):
    threadpoolctl = pytest.importorskip("threadpoolctl")
    model, data = wide_matmul(tmp_path)
    common = dict(model=model, data=data, loss="mse",
                  labels="target", batch_size=1000, steps=3, optimizer="sgd", lr=0.01,
                  seed=1, device="cpu", quiet=True)

    def trained(threads, **options):
        with threadpoolctl.threadpool_limits(threads, user_api="blas"):
            return run(RunOptions(**{**common, **options}), **(
                {"after_step": interrupt_at(1)} if options.get("checkpoint") and
                not options.get("resume") else {})).result
    straight = trained(2)
    if np.array_equal(trained(1).params["W"], straight.params["W"]):
        pytest.skip("this BLAS sums these products the same way on 1 and 2 threads")
    folder = str(tmp_path / "ckpt")
    assert trained(2, checkpoint=folder).steps_done == 1
    resumed = trained(1, checkpoint=folder, resume=True)   # another count in this process
    np.testing.assert_array_equal(resumed.params["W"], straight.params["W"])


def test_resume_can_extend_a_finished_run_by_epochs(tmp_path):
    folder = str(tmp_path / "ckpt")
    run(options(tmp_path, steps=None, epochs=1, checkpoint=folder))
    extended = run(options(tmp_path, steps=None, epochs=3, checkpoint=folder, resume=True))
    straight = run(options(tmp_path, steps=None, epochs=3))
    assert extended.result.steps_done == straight.result.steps_done == 30
    for name, value in straight.result.params.items():
        np.testing.assert_array_equal(extended.result.params[name], value, err_msg=name)

"""The loss history is bounded: however long a run, it keeps at most --history-rows rows
(merged in pairs, each row then covering ``stride`` steps), in memory and in the checkpoint;
the merged rows keep the counts and means the run's own steps give, and a resumed run's
history is the uninterrupted run's."""
from __future__ import annotations

import json
import math
import os
import signal

import numpy as np
import pytest
from support.training_runs import MLP, edited_checkpoint, mlp_data, write_npz

from graphopt.errors import GraphoptError
from graphopt.trainer import RunOptions, run
from graphopt.trainer import checkpoint as ckpt
from graphopt.trainer.history import History


def records(count: int, skipped_steps=(), seed: int = 0) -> list[dict]:
    """``count`` steps' records as the loop writes them, the steps in ``skipped_steps``
    skipped for a non-finite loss."""
    rng = np.random.default_rng(seed)
    out, skipped = [], 0
    for step in range(1, count + 1):
        bad = step in skipped_steps
        skipped += bad
        record = {"step": step, "epoch": (step - 1) // 10,
                  "loss": math.inf if bad else float(rng.uniform(1, 3)), "loss_scale": 1.0,
                  "skipped": skipped, "applied": not bad, "seconds": 0.25}
        if bad:
            record["nonfinite"] = "loss"
        out.append(record)
    return out


@pytest.mark.parametrize("count,capacity", [(100, 8), (64, 8), (65, 8), (37, 5), (8, 8),
                                            (7, 3), (20, 3), (9, 2)])
def test_rows_stay_within_capacity_and_keep_the_steps_counts_and_means(count, capacity):
    steps = records(count, skipped_steps={2, 3, 4, 20, 21, 22, 50})
    history = History(capacity)
    for record in steps:
        history.append(record)
    assert len(history) <= capacity
    stride = history.stride
    assert stride & (stride - 1) == 0
    assert (len(history) - 1) * stride < count <= len(history) * stride
    start = 0
    for index, row in enumerate(history):
        end = min((index + 1) * stride, count)
        covered = steps[start:end]
        assert row["step"] == end and row.get("steps", 1) == end - start
        assert row["epoch"] == steps[end - 1]["epoch"]
        assert row["skipped"] == covered[-1]["skipped"]
        assert row["applied"] == all(r["applied"] for r in covered)
        assert ("nonfinite" in row) == (not row["applied"])
        assert row["seconds"] == pytest.approx(0.25 * len(covered))
        trained = [r["loss"] for r in covered if r["applied"]]
        assert row["loss"] == pytest.approx(np.mean(trained) if trained else covered[-1]["loss"])
        start = end
    assert history.first_loss == steps[0]["loss"] and history.last_loss == steps[-1]["loss"]


def test_below_capacity_the_rows_are_the_steps_records():
    steps = records(20)
    history = History(20)
    for record in steps:
        history.append(record)
    assert history.stride == 1 and list(history) == steps and history.losses == \
        [r["loss"] for r in steps]


def test_a_million_steps_cost_the_capacity_not_the_steps():
    history = History()
    record = records(1)[0]
    for step in range(1, 1_000_001):
        history.append({**record, "step": step, "epoch": step // 1000})
    assert len(history) <= 4096 and history.stride == 256
    assert len(json.dumps(list(history))) < 1_500_000   # the checkpoint's share: ~0.3 KB a row


def test_evaluations_land_on_the_row_of_their_step_and_survive_merging():
    history = History(4)
    for record in records(16):
        history.append(record)
        if record["step"] % 5 == 0:
            history.note_evaluation({"eval_loss": float(record["step"])})
    # rows of 4 steps: the evaluation of step 5 in row 2, of 10 in row 3, of 15 in row 4
    assert [row.get("eval_loss") for row in history] == [None, 5.0, 10.0, 15.0]


# -- through the loop and the checkpoint ------------------------------------------------------
def options(tmp_path, **overrides) -> RunOptions:
    base = dict(model=MLP, data=write_npz(tmp_path / "d.npz", mlp_data(samples=40)),
                loss="cross_entropy", steps=30, batch_size=4, optimizer="adamw", lr=0.01,
                seed=5, device="cpu", quiet=True, history_rows=4, eval_every=7,
                eval_data=write_npz(tmp_path / "e.npz", mlp_data(samples=8, seed=9)))
    return RunOptions(**{**base, **overrides})


def untimed(history: History) -> list[dict]:
    """The rows without their wall-clock seconds (which no two runs share)."""
    return [{k: v for k, v in row.items() if k != "seconds"} for row in history]


def test_a_run_keeps_history_rows_and_its_resume_continues_the_same_history(tmp_path):
    straight = run(options(tmp_path))
    history = straight.result.history
    assert len(history) <= 4 and history.stride == 8 and history[-1]["step"] == 30
    assert sum(row.get("steps", 1) for row in history) == 30
    folder = str(tmp_path / "ckpt")

    def interrupt(step, record):
        if step == 13:
            os.kill(os.getpid(), signal.SIGINT)
    first = run(options(tmp_path, checkpoint=folder), after_step=interrupt)
    assert first.result.steps_done == 13
    saved = ckpt.load(folder)
    assert saved.history_stride == 4 and len(saved.history) == 4
    resumed = run(options(tmp_path, checkpoint=folder, resume=True))
    assert untimed(resumed.result.history) == untimed(history)
    assert resumed.result.history.first_loss == history.first_loss


def test_a_resume_with_fewer_rows_merges_the_saved_history(tmp_path):
    folder = str(tmp_path / "ckpt")
    run(options(tmp_path, steps=12, history_rows=64, checkpoint=folder))
    assert len(ckpt.load(folder).history) == 12
    resumed = run(options(tmp_path, steps=30, history_rows=4, checkpoint=folder, resume=True))
    assert untimed(resumed.result.history) == untimed(run(options(tmp_path)).result.history)


MERGED_ROW_EDITS = {
    "a row covering other steps": lambda m: m["history"][0].update(steps=3),
    "a stride that is not a power of 2": lambda m: m.update(history_stride=3),
    "a stride the rows do not have": lambda m: m.update(history_stride=8),
    "more skipped steps than the row covers": lambda m: m["history"][1].update(
        skipped=m["history"][0]["skipped"] + 5, applied=False, nonfinite="loss"),
    "counts per kind that disagree": lambda m: m.update(nonfinite={"loss": 2}),
    "an unknown kind counted": lambda m: m.update(nonfinite={"cosmic rays": 0}),
}


@pytest.mark.parametrize("edit", list(MERGED_ROW_EDITS))
def test_a_tampered_merged_history_is_refused(tmp_path, edit):
    folder = str(tmp_path / "ckpt")
    run(options(tmp_path, steps=12, checkpoint=folder))
    assert ckpt.load(folder).history_stride == 4
    bad = edited_checkpoint(folder, tmp_path / "bad", MERGED_ROW_EDITS[edit])
    with pytest.raises(GraphoptError, match="not a valid checkpoint"):
        ckpt.load(bad)


def test_merged_rows_keep_the_last_of_each_optional_value_and_the_later_kind():
    steps = records(5)
    steps[0].update(grad_norm=1.0, perplexity=9.0, eval_loss=3.0, eval_accuracy=0.5,
                    eval_perplexity=20.0)
    steps[1].update(applied=False, nonfinite="loss", skipped=1, loss=math.inf, perplexity=9.0)
    steps[2].update(applied=False, nonfinite="gradients", skipped=2, perplexity=9.0,
                    grad_norm=2.0)
    steps[3].update(skipped=2, perplexity=9.0)
    steps[4].update(skipped=2, perplexity=9.0)
    history = History(2)
    for record in steps:
        history.append(record)
    row = history[0]   # steps 1-4
    assert row["steps"] == 4 and row["nonfinite"] == "gradients" and not row["applied"]
    assert row["grad_norm"] == 2.0   # the latest step's that has one, not the first's
    assert (row["eval_loss"], row["eval_accuracy"], row["eval_perplexity"]) == (3.0, 0.5, 20.0)
    mean = (steps[0]["loss"] + steps[3]["loss"]) / 2   # the steps that trained
    assert row["loss"] == pytest.approx(mean) and row["perplexity"] == pytest.approx(math.exp(mean))


def test_merged_seconds_are_kept_to_the_microsecond():
    history = History(2)
    for record in records(4):
        history.append({**record, "seconds": 0.1234564})
    assert [row["seconds"] for row in history] == [round(2 * 0.1234564, 6)] * 2


def test_a_history_made_from_saved_rows_knows_its_first_and_last_loss():
    steps = records(6)
    saved = History(8, steps)
    assert saved.stride == 1 and len(saved) == 6
    assert saved.first_loss == steps[0]["loss"] and saved.last_loss == steps[-1]["loss"]
    exact = History(6, steps)   # exactly the capacity: nothing merged
    assert exact.stride == 1 and len(exact) == 6
    merged_rows = History(4, steps)   # fewer rows allowed than saved: merged until they fit
    assert merged_rows.stride == 2 and len(merged_rows) == 3
    assert merged_rows.first_loss == steps[0]["loss"]
    wide = History(4, list(merged_rows), stride=2, first_loss=7.5)
    assert wide.first_loss == 7.5
    assert History(4, list(merged_rows), stride=2).first_loss is None   # not known exactly


def test_a_capacity_below_two_is_refused():
    History(2)
    with pytest.raises(ValueError, match="at least 2 rows, not 1"):
        History(1)

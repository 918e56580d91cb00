"""bench/bench_training_scale.py without torch: which runs it makes, how it reads graphopt's
output, and how it judges its targets."""

import importlib
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.fixture()
def bench(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    for name in ("_common", "bench_scale", "bench_training_scale"):
        sys.modules.pop(name, None)
    module = importlib.import_module("bench_training_scale")
    yield module
    for name in ("_common", "bench_scale", "bench_training_scale"):
        sys.modules.pop(name, None)


def test_models_run_with_their_own_export_unless_exports_are_given(bench):
    args = bench.parse_args([])
    assert bench.pairs(args) == [("falcon-118m", "ts"), ("gpt2-124m", "dynamo"),
                                 ("falcon-1.1b", "ts")]
    args = bench.parse_args(["--models", "tiny-falcon", "tiny-gpt2", "--exports", "ts",
                             "dynamo"])
    assert len(bench.pairs(args)) == 4
    assert args.optimizer == ["sgd", "adamw"] and args.perturb


def test_graphopt_output_gives_tensors_steps_and_notes(bench, tmp_path):
    log = tmp_path / "steps.jsonl"
    log.write_text('{"step": 1, "loss": 6.5, "seconds": 0.2}\n'
                   '{"step": 2, "loss": 6.25, "seconds": 0.1}\n')
    run = bench.Run(1.0, 2_000_000, None, "note: 2 trained tensor(s) stand for ...\n"
                    "training 15 tensors (119,168 weights) for 2 steps of 4\n")
    side = bench.Side()
    bench.parse_graphopt(run, log, side)
    assert (side.tensors, side.weights) == (15, 119168)
    assert side.losses == [6.5, 6.25] and side.timed == [0.1]
    assert side.notes == ["2 trained tensor(s) stand for ..."] and side.ok


def test_targets(bench):
    def side(losses, rss=100e6, seconds=0.1):
        return bench.Side(losses=losses, seconds=[seconds] * len(losses), rss=rss)

    found = bench.targets("gpt2-124m", "sgd", side([6.0, 5.9], rss=105e6),
                          side([6.0, 5.9 + 2e-5], seconds=0.05))
    assert [ok for _, ok, _ in found] == [True, False, False]
    found = bench.targets("tiny-gpt2", "adamw", side([6.0, 5.9]), side([6.0, 5.9001]))
    assert [ok for _, ok, _ in found] == [True, True, True]
    failed = bench.Side(failure="failed (exit 1): no gradient definition")
    assert bench.targets("tiny-gpt2", "sgd", failed, side([6.0]))[0][1] is False

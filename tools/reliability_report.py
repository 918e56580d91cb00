#!/usr/bin/env python
"""The figures of the README "Reliability" section, in one command.

    python tools/reliability_report.py [--graphs 2000] [--kill-points 40]
                                         [--run-kill-points 36] [--seed N]

1. random valid graphs (tests/robustness/graphs.py) through graphopt.optimize, each checked
   by tests/robustness/oracle.py (validity, interface, values vs onnxruntime and the
   executor, fixpoint);
2. every hostile input of tests/robustness/make_hostile_corpus.py through `graphopt optimize` (and
   `graphopt run` when it exists), each checked like tests/robustness/test_hostile_files.py;
3. `graphopt optimize` of a big model killed (SIGKILL / SIGINT) at random moments, each
   checked like tests/robustness/test_interrupts.py;
4. `graphopt run --checkpoint-every 1` killed (SIGKILL at random steps and inside checkpoint
   writes, SIGINT at random steps) and resumed again and again, each interruption and each
   final resumed run checked like tests/robustness/test_run_faults.py;
5. two `graphopt optimize` runs at once to the same output with external data, round after
   round (tests/robustness/concurrency.py): the output must always be one complete pair.

Failures are listed; the exit code is 1 if anything failed that is not a known bug.

The figures are this tree's: it runs the graphopt this Python imports (and the `graphopt`
command beside it), which must be this tree installed (pip install -e .: the source folders
run only as an installed package); another checkout's install is refused (exit 2).
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import traceback
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))


def graphopt_elsewhere() -> str | None:
    """Why the graphopt this Python imports is not this tree's, or None: the report would
    measure another checkout (a shared environment's install of another worktree)."""
    try:
        import graphopt.cli
        import graphopt.executor
        import graphopt.trainer
    except ImportError as exc:
        return f"cannot import graphopt ({exc}): install this tree (pip install -e .)"
    files = [os.path.realpath(m.__file__)
             for m in (graphopt, graphopt.cli, graphopt.executor, graphopt.trainer)]
    outside = [f for f in files if not f.startswith(os.path.join(os.path.realpath(ROOT), ""))]
    if outside:
        return (f"this Python imports graphopt from {os.path.dirname(outside[0])}, not from "
                f"this tree {ROOT}: install this tree (pip install -e .) into an environment "
                "of its own and run the report with that environment's Python")
    return None


def random_graphs(count: int, seed: int | None):
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed
    from robustness.graphs import graphs
    from robustness.oracle import KnownBugHit, check_optimize

    tried, failures, known = 0, [], {}

    @settings(max_examples=count, deadline=None, database=None, phases=[Phase.generate],
              suppress_health_check=list(HealthCheck))
    @given(graphs(max_ops=16, yield_probability=0.3))
    def one(model_and_info):
        nonlocal tried
        model, _ = model_and_info
        tried += 1
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                check_optimize(model)
        except KnownBugHit as exc:
            known[str(exc)] = known.get(str(exc), 0) + 1
        except Exception as exc:  # collected, not raised: we want the count
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            failures.append((f"{type(exc).__name__}: {first}"[:200], model))

    if seed is not None:
        one = hseed(seed)(one)
    one()
    return tried, failures, known


def hostile_inputs():
    os.environ.setdefault("GRAPHOPT_HOSTILE_TRUNCATIONS", "24")
    from robustness import test_hostile_files as hostile

    rows = []
    commands = [("optimize", ["optimize", "-o", "{OUT}"], hostile.OPTIMIZE_BUGS)]
    if hostile._run_available():
        import numpy as np

        data = os.path.join(hostile._BUILD_DIR, "data.npz")
        np.savez(data, x=np.ones((4, 2, 4), np.float32))
        commands.append(("run", ["run", "--steps", "1", "--batch-size", "2", "--device", "cpu",
                                 "--data", data, "--loss", "output", "-o", "{OUT}"],
                         hostile.RUN_BUGS))
    for command, argv, known in commands:
        results, read = hostile._results_with_sentinel(argv)
        handled, failed = 0, []
        for name, result in results.items():
            try:
                hostile._check(result, hostile.CASES[name], command)
                handled += 1
            except AssertionError as exc:
                failed.append((name, name in known, str(exc).splitlines()[0][:160]))
        rows.append((command, len(results), handled, failed, read))
    hostile.teardown_module(None)
    return rows


def kill_points(count: int):
    from robustness.killpoints import build_big_model, hidden_files, run_kill_points

    with tempfile.TemporaryDirectory(prefix="graphopt-kill-") as tmp:
        model = build_big_model(os.path.join(tmp, "src"))
        results, seconds = run_kill_points(model, os.path.join(tmp, "out"), count, seed=11)
        leftovers = hidden_files(os.path.join(tmp, "out"))
    return results, seconds, leftovers


def run_kill_points(count: int):
    from robustness.killpoints import run_run_kill_points

    with tempfile.TemporaryDirectory(prefix="graphopt-run-kill-") as tmp:
        return run_run_kill_points(tmp, count, seed=13, chain=6)


def concurrent(rounds: int):
    from robustness.concurrency import concurrent_rounds

    with tempfile.TemporaryDirectory(prefix="graphopt-concurrent-") as tmp:
        start = time.perf_counter()
        problems = concurrent_rounds(tmp, rounds)
        return problems, time.perf_counter() - start


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--graphs", type=int, default=2000, help="random graphs to try")
    parser.add_argument("--kill-points", type=int, default=40,
                        help="interruptions of `graphopt optimize` to try")
    parser.add_argument("--run-kill-points", type=int, default=36,
                        help="interruptions of `graphopt run` to try")
    parser.add_argument("--concurrent-rounds", type=int, default=30,
                        help="rounds of two concurrent `graphopt optimize` to one output")
    parser.add_argument("--seed", type=int, default=None, help="hypothesis seed")
    parser.add_argument("--save-failures", metavar="DIR",
                        help="where to write failing random graphs (default: a temp folder)")
    parser.add_argument("--skip", action="append", default=[],
                        choices=["graphs", "hostile", "kill", "run-kill", "concurrent"],
                        help="leave a part out")
    args = parser.parse_args(argv)
    elsewhere = graphopt_elsewhere()
    if elsewhere:
        print(f"reliability_report: error: {elsewhere}", file=sys.stderr)
        return 2
    bad = 0
    lines = ["## Reliability (tools/reliability_report.py)", ""]

    if "graphs" not in args.skip:
        start = time.perf_counter()
        tried, failures, known = random_graphs(args.graphs, args.seed)
        took = time.perf_counter() - start
        hits = sum(known.values())
        lines.append(f"- Random graphs: {tried - len(failures) - hits} of {tried} random valid "
                     f"graphs passed (checker + strict inference, same interface, same values "
                     f"as onnxruntime and the executor, optimizing again changes nothing); "
                     f"{took:.0f} s" + (f"; {hits} hit known open bugs" if hits else ""))
        lines += [f"  - known bug ({count}x): {what}" for what, count in known.items()]
        if failures:
            keep = args.save_failures or tempfile.mkdtemp(prefix="graphopt-failures-")
            os.makedirs(keep, exist_ok=True)
            for i, (what, model) in enumerate(failures):
                path = os.path.join(keep, f"failure_{i:03d}.onnx")
                with open(path, "wb") as f:
                    f.write(model.SerializeToString())
                if i < 20:
                    lines.append(f"  - FAILED: {what} ({path})")
        bad += len(failures)

    if "hostile" not in args.skip:
        for command, total, handled, failed, read in hostile_inputs():
            known = sum(1 for _, k, _ in failed if k)
            lines.append(f"- Hostile inputs, `graphopt {command}`: {handled} of {total} handled "
                         f"(exit 1, one 'graphopt: error:' line, no traceback, nothing written)"
                         + (f"; {known} known open bug(s)" if known else "")
                         + ("; nothing read outside the model folder" if read is False else
                            "; READ OUTSIDE THE MODEL FOLDER" if read else ""))
            for name, is_known, why in failed:
                lines.append(f"  - {'known bug' if is_known else 'FAILED'}: {name}: {why}")
            bad += sum(1 for _, k, _ in failed if not k) + bool(read)

    if "kill" not in args.skip:
        results, seconds, leftovers = kill_points(args.kill_points)
        clean = [r for r in results if not r.problems]
        by_signal = {s: sum(1 for r in results if r.signal == s) for s in ("SIGKILL", "SIGINT")}
        complete = sum(1 for r in results if r.output_state == "complete")
        lines.append(f"- Interrupted `graphopt optimize` ({seconds:.1f} s per run): {len(clean)} "
                     f"of {len(results)} kill points ({by_signal['SIGKILL']} SIGKILL, "
                     f"{by_signal['SIGINT']} SIGINT) with zero corruption (output absent: "
                     f"{len(results) - complete}, complete: {complete}, partial: 0); hidden "
                     f"temporary files left by SIGKILL: {len(leftovers)}")
        notes = sorted({note for r in results for note in r.notes})
        lines += [f"  - note: {note}" for note in notes]
        for r in results:
            lines += [f"  - FAILED: {r.signal} at {r.delay:.2f}s: {p}" for p in r.problems]
        bad += len(results) - len(clean)

    if "run-kill" not in args.skip:
        start = time.perf_counter()
        results, chains, step_seconds = run_kill_points(args.run_kill_points)
        took = time.perf_counter() - start
        clean = [r for r in results if not r.problems]
        kinds: dict[str, int] = {}
        for r in results:
            key = f"{r.signal} {r.how}"
            kinds[key] = kinds.get(key, 0) + 1
        in_write = sum(1 for r in results if r.in_write)
        at_step_in_write = sum(1 for r in results if r.in_write and r.how == "at step")
        equal = sum(1 for c in chains if c.final_equal and not c.problems)
        finished = sum(1 for r in results if r.returncode == 0)
        lines.append(
            f"- Interrupted `graphopt run --checkpoint-every 1` ({step_seconds * 1000:.1f} ms "
            f"per step): {len(clean)} of {len(results)} kill points ("
            + ", ".join(f"{count} {kind}" for kind, count in kinds.items())
            + f") with zero corruption (checkpoint absent or complete, never partial; every "
            f"checkpoint loads and equals the uninterrupted run's state at its step); "
            f"{equal} of {len(chains)} chains of interruptions resumed to bit-identical final "
            f"weights; {in_write} SIGKILLs landed inside a checkpoint save, before its rename "
            f"({at_step_in_write} of them from the random-step kills), each leaving only a "
            f"hidden temporary file, "
            f"removed by the next save; {took:.0f} s"
            + (f"; {finished} run(s) finished before the signal" if finished else ""))
        for r in results:
            lines += [f"  - FAILED: {r.signal} {r.how} ({r.moment}): {p}" for p in r.problems]
        for c in chains:
            lines += [f"  - FAILED: resume: {p}" for p in c.problems]
        bad += len(results) - len(clean) + sum(1 for c in chains if c.problems)

    if "concurrent" not in args.skip:
        problems, took = concurrent(args.concurrent_rounds)
        lines.append(f"- Concurrent `graphopt optimize` to one output (external data): "
                     f"{args.concurrent_rounds - len(problems)} of {args.concurrent_rounds} "
                     f"rounds of two simultaneous runs left a complete model + data pair (the "
                     f"model of one run with that run's weights); {took:.0f} s")
        lines += [f"  - FAILED: {p}" for p in problems]
        bad += len(problems)

    print("\n".join(lines))
    return 1 if bad else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except Exception:
        traceback.print_exc()
        sys.exit(2)

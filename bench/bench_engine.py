"""Rewrite engine vs onnxscript's rewriter on a chain of N blocks (issue 2).

Each block is MatMul(x, Transpose(W)) -> Mul(scalar) -> Add; both tools apply the same rule,
MatMul(a, Transpose(b, perm=[1, 0])) -> com.microsoft FusedMatMul(a, b, transB=1).
Measured side by side in one run:
- rewrite phase, model already in memory (graphopt: a loaded Model; onnxscript: its IR);
  graphopt's time includes its per-rewrite checks, and its whole-model validation (ONNX
  checker + strict shape inference) is shown separately;
- end to end from file to file (graphopt: load + check, optimize, validate, atomic save;
  onnxscript: onnx.load, rewrite, onnx.save).

    python bench/bench_engine.py [--sizes 1000 10000 50000] [--runs 3] [--no-write]
"""
from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
import tempfile
import time

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

import graphopt
from graphopt import modelio
from graphopt.api import select_rules
from graphopt.engine import Engine, validate
from graphopt.report import Report

from _common import interleaved_medians, machine, write_section

RULE = "matmul_transpose_to_fused_matmul"
WIDTH = 8


def chain(blocks: int) -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    nodes, inits, x = [], [], "x"
    for i in range(blocks):
        inits += [numpy_helper.from_array(rng.random((WIDTH, WIDTH), np.float32), f"W{i}"),
                  numpy_helper.from_array(np.array(0.5, np.float32), f"s{i}"),
                  numpy_helper.from_array(np.zeros(WIDTH, np.float32), f"b{i}")]
        nodes += [helper.make_node("Transpose", [f"W{i}"], [f"Wt{i}"], perm=[1, 0]),
                  helper.make_node("MatMul", [x, f"Wt{i}"], [f"m{i}"]),
                  helper.make_node("Mul", [f"m{i}", f"s{i}"], [f"u{i}"]),
                  helper.make_node("Add", [f"u{i}", f"b{i}"], [f"y{i}"])]
        x = f"y{i}"
    graph = helper.make_graph(nodes, "chain",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, WIDTH])],
                              [helper.make_tensor_value_info(x, TensorProto.FLOAT, [2, WIDTH])],
                              inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def onnxscript_rule():
    from onnxscript.rewriter import pattern

    def target(op, a, b):
        return op.MatMul(a, op.Transpose(b, perm=[1, 0]))

    def replacement(op, a, b):
        return op.FusedMatMul(a, b, transB=1, _domain="com.microsoft")

    return pattern.RewriteRuleSet([pattern.RewriteRule(target, replacement)])


def measure(blocks: int, runs: int, folder: str) -> dict:
    import onnxscript.ir as ir
    from onnxscript.rewriter import rewrite

    proto = chain(blocks)
    path = os.path.join(folder, f"chain{blocks}.onnx")
    onnx.save(proto, path)
    rules = select_rules([RULE])
    theirs = onnxscript_rule()
    fused = {}

    def ours_rewrite(model):
        report = Report()
        Engine(rules).run(model, report)
        fused["graphopt"] = report.total_rewrites

    def theirs_rewrite(model):
        fused["onnxscript"] = theirs.apply_to_model(model)

    # Each round gives both tools a fresh in-memory model (untimed) and times only the
    # rewrite, the two taking turns so that load from other processes hits both alike.
    contenders = {"graphopt": (lambda: modelio.load(proto, check=False), ours_rewrite),
                  "onnxscript": (lambda: ir.serde.deserialize_model(proto), theirs_rewrite),
                  "validate": (lambda: _rewritten(proto, rules), validate)}
    times = {name: [] for name in contenders}
    for _ in range(runs):
        for name, (make, apply) in contenders.items():
            state = make()
            start = time.perf_counter()
            apply(state)
            times[name].append(time.perf_counter() - start)

    out_ours = os.path.join(folder, "out_graphopt.onnx")
    out_theirs = os.path.join(folder, "out_onnxscript.onnx")

    def ours_e2e():
        graphopt.optimize_file(path, out_ours, rules=[RULE])

    def theirs_e2e():
        onnx.save(rewrite(onnx.load(path), pattern_rewrite_rules=theirs), out_theirs)

    e2e = interleaved_medians({"graphopt": ours_e2e, "onnxscript": theirs_e2e}, runs,
                              warmup=False)
    check = onnx.load(out_ours)
    assert sum(n.op_type == "FusedMatMul" for n in check.graph.node) == blocks
    assert fused["graphopt"] == fused["onnxscript"] == blocks, fused
    return {"blocks": blocks, "nodes": 4 * blocks,
            "engine": min(times["graphopt"]), "engine_median": statistics.median(times["graphopt"]),
            "validate": min(times["validate"]), "onnxscript": min(times["onnxscript"]),
            "onnxscript_median": statistics.median(times["onnxscript"]),
            "e2e_graphopt": e2e["graphopt"], "e2e_onnxscript": e2e["onnxscript"]}


def _rewritten(proto, rules):
    model = modelio.load(proto, check=False)
    Engine(rules).run(model, Report())
    return model


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[1000, 10000, 50000])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for blocks in args.sizes:
            rows.append(measure(blocks, args.runs, folder))
            print(rows[-1], flush=True)
    lines = ["| blocks | nodes | graphopt rewrite s | + validation s | onnxscript rewrite s "
             "| speed-up (best) | speed-up (median) | graphopt e2e s | onnxscript e2e s "
             "| e2e speed-up |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(
            f"| {r['blocks']} | {r['nodes']} | {r['engine']:.3f} | {r['validate']:.3f} | "
            f"{r['onnxscript']:.3f} | {r['onnxscript'] / r['engine']:.2f}x | "
            f"{r['onnxscript_median'] / r['engine_median']:.2f}x | "
            f"{r['e2e_graphopt']:.3f} | {r['e2e_onnxscript']:.3f} | "
            f"{r['e2e_onnxscript'] / r['e2e_graphopt']:.2f}x |")
    if len(rows) >= 2:
        first, last = rows[0], rows[-1]
        slope = (math.log(last["engine"]) - math.log(first["engine"])) / (
            math.log(last["blocks"]) - math.log(first["blocks"]))
        lines.append("")
        lines.append(f"Growth of graphopt's rewrite time from {first['blocks']} to "
                     f"{last['blocks']} blocks: log-log slope {slope:.2f} (target <= 1.1).")
    lines += ["", "Speed-up = onnxscript time / graphopt time (targets: rewrite >= 4x at 10,000 "
              "blocks, end to end > 1x). Rewrite columns: the best of the interleaved runs "
              "(each tool's own cost, least disturbed by other processes), and the ratio of "
              "medians beside it; end to end: medians.",
              f"Machine: {machine()}; onnx {onnx.__version__}.",
              "Command: `python bench/bench_engine.py`"]
    table = "\n".join(lines)
    print(table)
    if not args.no_write:
        write_section("Rewrite engine vs onnxscript (issue 2)", table)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""CPU float32 Falcon-style MQA attention block: graphopt executor vs onnxruntime vs
onnx.reference.ReferenceEvaluator, each in processes of its own (see _common for the method).
Writes its section of bench/RESULTS.md.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/bench_executor_cpu.py [--runs 9]

About 50 s on a quiet 2-core machine.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import onnx
from _common import (
    MIN_RUNS,
    command_line,
    in_processes,
    machine,
    med_min,
    publish,
    time_calls,
    worker_report,
)
from onnx import TensorProto, helper, numpy_helper

BATCH, SEQ, HIDDEN, HEADS = 8, 256, 1024, 16
HEAD_DIM = HIDDEN // HEADS
SECTION = "Executor CPU: MQA block inference"
# untimed runs in each process first: the executor's first runs after start-up take up to 1.6x
# its steady time (230-270 ms for the first four timed runs after two warm-ups, then 155-185):
# NumPy asks for huge pages for its 33 MB tensors and the kernel compacts memory for them,
# 70-120 ms of system time a run for the first six runs, then 0-30 ms; onnxruntime's runs are
# steady from the first; every runtime gets the same warm-up
WARMUP = 6


def build_mqa_block() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    qkv_w = (rng.standard_normal((HIDDEN, HIDDEN + 2 * HEAD_DIM))
             / np.sqrt(HIDDEN)).astype(np.float32)
    out_w = (rng.standard_normal((HIDDEN, HIDDEN)) / np.sqrt(HIDDEN)).astype(np.float32)
    i64 = lambda name, v: numpy_helper.from_array(np.array(v, dtype=np.int64), name)  # noqa: E731
    inits = [
        numpy_helper.from_array(qkv_w, "qkv_w"), numpy_helper.from_array(out_w, "out_w"),
        i64("qkv_shape", [BATCH, SEQ, HEADS + 2, HEAD_DIM]),
        i64("q_start", [0]), i64("q_end", [-2]), i64("axis2", [2]),
        i64("k_index", -2), i64("v_index", -1),
        numpy_helper.from_array(np.array(1.0 / np.sqrt(HEAD_DIM), np.float32), "scale"),
        i64("out_shape", [BATCH, SEQ, HIDDEN]),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "qkv_w"], ["qkv"], name="qkv_proj"),
        helper.make_node("Reshape", ["qkv", "qkv_shape"], ["qkv4"], name="split_heads"),
        helper.make_node("Slice", ["qkv4", "q_start", "q_end", "axis2"], ["q"], name="q_slice"),
        helper.make_node("Gather", ["qkv4", "k_index"], ["k"], name="k_gather", axis=2),
        helper.make_node("Gather", ["qkv4", "v_index"], ["v"], name="v_gather", axis=2),
        helper.make_node("Transpose", ["q"], ["q_t"], name="q_t", perm=[0, 2, 1, 3]),  # b,h,s,d
        helper.make_node("Transpose", ["k"], ["k_t"], name="k_t", perm=[0, 2, 1]),  # b,d,s
        helper.make_node("Unsqueeze", ["k_t", "one"], ["k_t4"], name="k_unsq"),  # b,1,d,s
        helper.make_node("Unsqueeze", ["v", "one"], ["v4"], name="v_unsq"),  # b,1,s,d
        helper.make_node("MatMul", ["q_t", "k_t4"], ["scores"], name="qk"),
        helper.make_node("Mul", ["scores", "scale"], ["scaled"], name="scale"),
        helper.make_node("Softmax", ["scaled"], ["probs"], name="softmax", axis=-1),
        helper.make_node("MatMul", ["probs", "v4"], ["ctx"], name="pv"),  # b,h,s,d
        helper.make_node("Transpose", ["ctx"], ["ctx_t"], name="ctx_t", perm=[0, 2, 1, 3]),
        helper.make_node("Reshape", ["ctx_t", "out_shape"], ["ctx2"], name="merge_heads"),
        helper.make_node("MatMul", ["ctx2", "out_w"], ["y"], name="out_proj"),
    ]
    inits.append(i64("one", [1]))
    graph = helper.make_graph(
        nodes, "falcon_mqa",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [BATCH, SEQ, HIDDEN])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [BATCH, SEQ, HIDDEN])],
        initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    return model


RUNTIMES = {
    "graphopt": "graphopt executor (numpy), after `graphopt optimize`",
    "graphopt_raw": "graphopt executor (numpy), the graph as built",
    "onnxruntime": "onnxruntime CPU (default options)",
    "reference": "onnx.reference.ReferenceEvaluator",
    "projections": "numpy: the two projection GEMMs alone (81% of the FLOPs)",
}


def _inputs():
    return {"x": np.random.default_rng(1).standard_normal((BATCH, SEQ, HIDDEN)).astype(np.float32)}


def _runner(runtime: str, model: onnx.ModelProto):
    if runtime in ("graphopt", "graphopt_raw"):
        import graphopt
        from graphopt.executor import Session

        if runtime == "graphopt":  # as onnxruntime runs its own graph optimizations
            model, _ = graphopt.optimize(model)
        session = Session(model, device="cpu")
        return lambda feeds: session.run(feeds)["y"]
    if runtime == "onnxruntime":
        import onnxruntime as ort

        session = ort.InferenceSession(model.SerializeToString(),
                                       providers=["CPUExecutionProvider"])
        return lambda feeds: session.run(None, feeds)[0]
    if runtime == "projections":  # a floor for any numpy runtime: its two largest products
        weights = {i.name: numpy_helper.to_array(i) for i in model.graph.initializer}
        qkv_w, out_w = weights["qkv_w"], weights["out_w"]
        return lambda feeds: (feeds["x"].reshape(-1, HIDDEN) @ qkv_w, feeds["x"].reshape(
            -1, HIDDEN) @ out_w)[1]
    from onnx.reference import ReferenceEvaluator

    reference = ReferenceEvaluator(model)
    return lambda feeds: reference.run(None, feeds)[0]


def worker(runtime: str, runs: int) -> None:
    run, feeds = _runner(runtime, build_mqa_block()), _inputs()
    if runtime == "check":
        return
    extra = {}
    if runtime.startswith("graphopt"):
        from graphopt.executor import describe_compiled_kernels

        extra["kernels"] = describe_compiled_kernels()
    worker_report(time_calls(lambda: run(feeds), runs, warmup=WARMUP), **extra)


def check() -> None:
    """Same answer from all three (one process, untimed)."""
    model, feeds = build_mqa_block(), _inputs()
    theirs = _runner("onnxruntime", model)(feeds)
    for runtime in ("graphopt", "graphopt_raw"):
        np.testing.assert_allclose(_runner(runtime, model)(feeds), theirs, rtol=1e-3, atol=1e-4)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=MIN_RUNS)
    parser.add_argument("--no-write", action="store_true", help="do not update bench/RESULTS.md")
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.runs)
        return 0
    check()
    results = in_processes(__file__, {name: [name] for name in RUNTIMES}, args.runs)
    ms = {name: med_min(r["times"]) for name, r in results.items()}
    ort_med, ort_min = ms["onnxruntime"]
    ours_med, ours_min = ms["graphopt"]
    ref_med, ref_min = ms["reference"]
    import onnxruntime as ort

    table = [
        f"Falcon-style MQA attention block, float32, batch {BATCH}, seq {SEQ}, hidden {HIDDEN}, "
        f"{HEADS} heads (+1 shared K/V head). Each runtime in processes of its own (3 rounds, "
        f"the runtimes taking turns), {WARMUP} warm-up runs in each process, then "
        f"{len(results['graphopt']['times'])} timed runs each. onnxruntime runs its default "
        "graph optimizations (its Split and MatMul-scale fusions among them); graphopt's "
        "executor is timed on the graph `graphopt optimize` writes (the same two fusions) "
        "and on the graph as built.",
        "",
        "| Runtime | median ms | min ms | median vs onnxruntime |",
        "|---|---|---|---|",
    ]
    table += [f"| {label} | {ms[name][0]:.1f} | {ms[name][1]:.1f} | "
              f"{ms[name][0] / ort_med:.2f}x |" for name, label in RUNTIMES.items()]
    table += [
        "",
        f"executor / onnxruntime = {ours_med / ort_med:.2f} (minimums {ours_min / ort_min:.2f}; "
        f"target <= 1.3); ReferenceEvaluator / executor = {ref_med / ours_med:.2f} (minimums "
        f"{ref_min / ours_min:.2f}; target >= 2). Both run their products on the same numpy "
        f"and OpenBLAS, so the reference's time over the two projection GEMMs' alone bounds "
        f"that ratio: {ref_med / ms['projections'][0]:.2f} (minimums "
        f"{ref_min / ms['projections'][1]:.2f}).",
        f"Machine: {machine()}; numpy {np.__version__}, onnxruntime {ort.__version__}, "
        f"onnx {onnx.__version__}; BLAS in the workers: {results['graphopt']['blas'][0]}; "
        f"graphopt's float32 row and activation kernels: {results['graphopt']['kernels'][0]}.",
        f"Command: `{command_line('bench_executor_cpu.py', argv)}`",
    ]
    publish(SECTION, table, write=not args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""CPU float32 Falcon-style MQA attention block: graphopt executor vs onnxruntime vs
onnx.reference.ReferenceEvaluator. Writes its section of bench/RESULTS.md.

    python bench/bench_executor_cpu.py [--runs 5]
"""

from __future__ import annotations

import argparse
import platform
import sys

import numpy as np
import onnx
import onnxruntime as ort
from _common import interleaved_medians, publish
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from graphopt.executor import Session

BATCH, SEQ, HIDDEN, HEADS = 8, 256, 1024, 16
HEAD_DIM = HIDDEN // HEADS
SECTION = "Executor CPU (issue 4)"


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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--runs", type=int, default=7)
    parser.add_argument("--no-write", action="store_true", help="do not update bench/RESULTS.md")
    args = parser.parse_args(argv)

    model = build_mqa_block()
    x = np.random.default_rng(1).standard_normal((BATCH, SEQ, HIDDEN)).astype(np.float32)
    feeds = {"x": x}

    ours = Session(model, device="cpu")
    ort_session = ort.InferenceSession(model.SerializeToString(),
                                       providers=["CPUExecutionProvider"])
    reference = ReferenceEvaluator(model)

    y_ours = ours.run(feeds)["y"]
    y_ort = ort_session.run(None, feeds)[0]
    np.testing.assert_allclose(y_ours, y_ort, rtol=1e-3, atol=1e-4)

    medians = interleaved_medians({
        "ours": lambda: ours.run(feeds),
        "ort": lambda: ort_session.run(None, feeds),
        "ref": lambda: reference.run(None, feeds),
    }, args.runs)
    t_ours, t_ort, t_ref = medians["ours"], medians["ort"], medians["ref"]

    command = "python bench/bench_executor_cpu.py " + " ".join(
        argv if argv is not None else sys.argv[1:])
    rows = [
        ("graphopt executor (numpy)", t_ours),
        ("onnxruntime CPU (default options)", t_ort),
        ("onnx.reference.ReferenceEvaluator", t_ref),
    ]
    table = [
        f"Falcon-style MQA attention block, float32, batch {BATCH}, seq {SEQ}, hidden {HIDDEN}, "
        f"{HEADS} heads (+1 shared K/V head); median of {args.runs} interleaved runs "
        "after warm-up.",
        "",
        "| Runtime | median ms | vs onnxruntime |",
        "|---|---|---|",
    ]
    table += [f"| {name} | {t * 1e3:.1f} | {t / t_ort:.2f}x |" for name, t in rows]
    table += [
        "",
        f"executor / onnxruntime = {t_ours / t_ort:.2f} (target <= 1.5); "
        f"ReferenceEvaluator / executor = {t_ref / t_ours:.2f} (target >= 1.5).",
        f"Machine: {platform.machine()}, {platform.processor() or 'cpu'}; numpy {np.__version__}, "
        f"onnxruntime {ort.__version__}, onnx {onnx.__version__}.",
        f"Command: `{command.strip()}`",
    ]
    publish(SECTION, table, write=not args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())

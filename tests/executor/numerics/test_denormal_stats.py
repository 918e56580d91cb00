import json

import numpy as np
import pytest

from graphopt.executor.numerics import (
    BackwardPassGuard,
    Fp16Policy,
    Numerics,
    format_denormal_table,
)

D = 2.0**-20  # FP16 subnormal
S = 2.0**-8  # normal, but S * S = 2**-16 is subnormal


def hand_built_operands():
    # a @ b = [[D + S*S, -S*D], [1, 0]] = [[2**-20 + 2**-16, -2**-28], [1, 0]]
    a = np.array([[D, S], [1.0, 0.0]], dtype=np.float16)  # 1 subnormal
    b = np.array([[1.0, 0.0], [S, -D]], dtype=np.float16)  # 1 subnormal
    return a, b


def test_counts_on_a_hand_built_example():
    numerics = Numerics(mode="mi200", policy=Fp16Policy(), collect_stats=True)
    a, b = hand_built_operands()
    numerics.current_node = "MatMul_0"
    forward = numerics.matmul(a, b)  # original: flushed inputs give [[S*S, 0], [1, 0]]
    assert forward.tolist() == [[0.0, 0.0], [1.0, 0.0]]  # ... and S*S is flushed too
    numerics.current_node = "MatMul_0_Grad"
    with BackwardPassGuard():
        backward = numerics.matmul(a, b)  # alternate: D + S*S kept; -2**-28 rounds to -0
    assert backward[0, 0] == np.float16(D + S * S)
    numerics.matmul(a.astype(np.float32), b.astype(np.float32))  # not FP16: not counted

    report = numerics.denormal_report()
    json.dumps(report)  # JSON-able
    fwd = report["nodes"]["MatMul_0"]["forward"]
    assert fwd == {"calls": 1, "original_calls": 1, "alternate_calls": 0, "input_values": 8,
                   "output_values": 4, "input_denormals": 2, "output_denormals": 0,
                   "mi200_flushes": 3}  # 2 inputs + the pre-flush S*S output
    assert report["nodes"]["MatMul_0"]["backward"]["calls"] == 0
    bwd = report["nodes"]["MatMul_0_Grad"]["backward"]
    assert bwd == {"calls": 1, "original_calls": 0, "alternate_calls": 1, "input_values": 8,
                   "output_values": 4, "input_denormals": 2, "output_denormals": 1,
                   "mi200_flushes": 3}
    assert report["totals"]["forward"]["mi200_flushes"] == 3
    assert report["totals"]["backward"]["output_denormals"] == 1
    assert report["mode"] == "mi200" and report["flush"] == "emulated"
    assert report["policy"]["gemm_backward"] == "alternate"


def test_native_mode_counts_what_mi200_would_flush():
    numerics = Numerics(mode="native", policy=Fp16Policy(), collect_stats=True)
    a, b = hand_built_operands()
    numerics.matmul(a, b)  # native original keeps everything
    counts = numerics.denormal_report()["nodes"]["<unnamed>"]["forward"]
    assert counts["input_denormals"] == 2
    assert counts["output_denormals"] == 1  # 2**-20 + 2**-16 survives natively
    assert counts["mi200_flushes"] == 3


def test_table_lists_worst_nodes_first():
    numerics = Numerics(mode="mi200", policy=Fp16Policy(), collect_stats=True)
    a, b = hand_built_operands()
    clean = np.ones((2, 2), np.float16)
    for node, (x, y), repeats in [("quiet", (clean, clean), 3), ("noisy", (a, b), 2),
                                  ("mild", (a, clean), 1)]:
        numerics.current_node = node
        for _ in range(repeats):
            numerics.matmul(x, y)
    table = numerics.format_denormal_table(top=2)
    lines = table.splitlines()
    assert lines[0] == "FP16 denormals, worst 2 of 3 nodes"
    assert lines[3].startswith("noisy") and lines[4].startswith("mild")
    # flush (6) exceeds in + out (4 + 0): the original path flushed the result it returned
    assert lines[3].split()[1:4] == ["4", "0", "6"]
    assert lines[-1].startswith("in: FP16 subnormals among the operands; out: in the result "
                                "returned; flush:") and "more than in + out" in lines[-1]
    assert "quiet" not in table
    assert format_denormal_table(numerics.denormal_report(), top=5).count("\n") == 6


def test_report_needs_collect_stats():
    with pytest.raises(RuntimeError, match="collect_stats"):
        Numerics(mode="native").denormal_report()

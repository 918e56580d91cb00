"""The fused-QKV families table (README, bench/RESULTS.md): for each tiny Hugging Face model
of tests/fixtures/make_hf_fixtures.py and each exporter, what graphopt (level 2) and
onnxruntime (ORT_ENABLE_EXTENDED, CPU) make of it, the error against PyTorch's logits, and a
5-step SGD training run on the executor against PyTorch's.

    python bench/bench_families.py [--no-write]

No timings: counts and errors only, so the machine's load does not matter.
"""
from __future__ import annotations

import argparse
import os
import sys
import tempfile

from _common import publish

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "tests"))
from support import hf_families  # noqa: E402

SECTION = "Fused-QKV families: Split and FusedMatMul fusions, errors vs PyTorch"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        names = sorted(hf_families.fixture_names(),
                       key=lambda n: (hf_families.load(n)[2]["family"], n))
        for name in names:
            r = hf_families.survey(name, os.path.join(scratch, "ort.onnx"), train=True)
            made = (f"{r.splits_per_layer:g} (the exporter wrote {r.exporter_splits})"
                    if not r.splits_made else f"{r.splits_per_layer:g}")
            rows.append(f"| {r.family} | {r.exporter} | {made} | {r.splits} / {r.ort_splits} "
                        f"| {r.fused} / {r.ort_fused} | {r.gelus} / {r.ort_gelus} "
                        f"| {r.matmul_like} / {r.ort_matmul_like} "
                        f"| {max(r.ort_error, r.executor_error):.1e} "
                        f"| {r.loss_difference:.1e} |")
    lines = [
        "Tiny random-weight models built from configs (hidden 32, 4 heads, 2 layers, vocab 64),",
        "exported with dynamic batch and sequence by TorchScript (`ts17`, opset 17) and dynamo",
        "(`dynamo18`, opset 18); `tests/fixtures/make_hf_fixtures.py` makes them. graphopt at",
        "level 2 against onnxruntime's own `ORT_ENABLE_EXTENDED` (CPU). *Split fusions per",
        "layer*: Splits `gather_slice_to_split` made, per layer. *GELU*: Gelu, FastGelu and",
        "BiasGelu nodes (`gelu_fusion`, `fast_gelu_fusion`; Persimmon and Phi-3 have none).",
        "*Transpose+MatMul*: Transpose, MatMul, FusedMatMul and Gemm nodes left (fewer is better).",
        "FusedMatMul counts include a GELU's 0.5 folded into the next product's alpha where the",
        "GELU is not fused. *max error*: largest |logits -",
        "PyTorch's| of graphopt's model in onnxruntime and in the executor. *loss difference*:",
        "largest relative difference of the loss over 5 SGD steps (lr 0.5) trained on the",
        "executor, against PyTorch's run of the same model.",
        "",
        "| family | exporter | Split fusions per layer | Split nodes graphopt / ORT "
        "| FusedMatMul graphopt / ORT | GELU graphopt / ORT | Transpose+MatMul graphopt / ORT "
        "| max error | loss difference |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        "Command: `python bench/bench_families.py`",
    ]
    publish(SECTION, lines, not args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())

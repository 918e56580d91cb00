"""Training step time of the MQA example with and without the Split fusion
(gather_slice_to_split disabled), side by side in one run. Writes its section of
bench/RESULTS.md.

    python bench/bench_training.py [--runs 15]

One step = one executor run of the training graph (forward, YieldOp, backward: the part the
fusion changes; the optimizer update is the same for both and left out). Without the
fusion the gradient of fused_qkv is SliceGrad + 2 GatherGrad, each a zero tensor of the
whole fused_qkv shape, then a Sum of the three; with it, one Concat of the pieces.
ONNX Runtime reports ~7% end-to-end for Falcon training from this fusion.
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np
from _common import interleaved_medians, machine, write_section

from graphopt.examples.mqa import MqaConfig, build_mqa_model
from graphopt.executor import Session
from graphopt.executor.train import build

SECTION = "Training step: Split fusion (issue 6)"
CONFIGS = [  # (label, model config, batch)
    ("`--example mqa` defaults", MqaConfig(vocab=56), 32),
    ("wider (hidden 256, 8 heads, seq 128)", MqaConfig(vocab=56, seq=128, hidden=256, heads=8,
                                                       mlp=1024), 8),
]


def gpu_device() -> str | None:
    try:
        import cupy

        return "rocm" if cupy.cuda.runtime.is_hip else "cuda"
    except Exception:  # no CuPy, or no device
        return None


def step_function(cfg: MqaConfig, batch: int, device: str, disable: tuple[str, ...]):
    graph = build(build_mqa_model(cfg), loss="cross_entropy", labels="labels", disable=disable)
    session = Session(graph.proto, device=device, numerics=None)
    rng = np.random.default_rng(0)
    feeds = {"input_ids": rng.integers(0, cfg.vocab, (batch, cfg.seq)),
             "labels": rng.integers(0, cfg.vocab, (batch, cfg.seq)), **graph.initial}
    fetches = graph.losses + list(graph.grads.values())
    ops = [n.op_type for n in graph.proto.graph.node]
    return (lambda: session.run(feeds, fetches)), ops


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args(argv)
    devices = ["cpu"]
    gpu = gpu_device()
    if gpu:
        devices.append(gpu)
    else:
        print("GPU: skipped (CuPy or a GPU is not available)")
    rows = []
    for device in devices:
        for label, cfg, batch in CONFIGS:
            fused, fused_ops = step_function(cfg, batch, device, ())
            plain, plain_ops = step_function(cfg, batch, device, ("gather_slice_to_split",))
            assert "Split" in fused_ops and "Split" not in plain_ops
            medians = interleaved_medians({"fused": fused, "plain": plain}, args.runs)
            gain = (medians["plain"] - medians["fused"]) / medians["plain"] * 100
            rows.append(f"| {device} | {label}, batch {batch} | {medians['plain'] * 1e3:.2f} | "
                        f"{medians['fused'] * 1e3:.2f} | {gain:+.1f}% |")
            print(rows[-1], flush=True)
    body = "\n".join([
        "MQA character LM training step (forward + backward, float32), with and without "
        "`gather_slice_to_split`; median of "
        f"{args.runs} interleaved runs after warm-up. ONNX Runtime reports ~7% end-to-end "
        "for Falcon training from its GatherSliceToSplitFusion.",
        "",
        "| device | model | no Split fusion ms | Split fusion ms | gain |",
        "|---|---|---|---|---|",
        *rows,
        "",
        ("GPU: not run (no CuPy/GPU on this machine)." if not gpu else ""),
        f"Machine: {machine()}; numpy {np.__version__}; load average during the run "
        f"{os.getloadavg()[0]:.1f} (a quiet machine runs the default step in ~16 ms; above "
        "~1 per core the medians are noise).",
        "Command: `python bench/bench_training.py`",
    ])
    write_section(SECTION, body)
    return 0


if __name__ == "__main__":
    sys.exit(main())

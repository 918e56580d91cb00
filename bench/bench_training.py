"""Training step time of the MQA example with and without the Split fusion
(gather_slice_to_split disabled), each variant in processes of its own (see _common for
the method). Writes its section of bench/RESULTS.md.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/bench_training.py [--runs 9]

About 1 minute on a quiet 2-core machine (CPU only; a GPU adds its rows).

One step = one executor run of the training graph (forward, YieldOp, backward: the part the
fusion changes; the optimizer update is the same for both and left out). Without the
fusion the gradient of fused_qkv is SliceGrad + 2 GatherGrad, each a zero tensor of the
whole fused_qkv shape, then a Sum of the three; with it, one Concat of the pieces.
ONNX Runtime reports ~7% end-to-end for Falcon training from this fusion.
"""
from __future__ import annotations

import argparse
import sys

import numpy as np
from _common import (
    MIN_RUNS,
    STEP_WARMUP,
    command_line,
    in_processes,
    machine,
    med_min,
    publish,
    time_calls,
    worker_report,
)

from graphopt.examples.mqa import MqaConfig, build_mqa_model
from graphopt.executor import Session
from graphopt.trainer import build

SECTION = "Training step: Split fusion"
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


def worker(device: str, config: int, variant: str, runs: int) -> None:
    _, cfg, batch = CONFIGS[config]
    disable = ("gather_slice_to_split",) if variant == "plain" else ()
    step, ops = step_function(cfg, batch, device, disable)
    assert ("Split" in ops) == (variant == "fused")
    worker_report(time_calls(step, runs, warmup=STEP_WARMUP))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=MIN_RUNS)
    parser.add_argument("--no-write", action="store_true", help="do not update bench/RESULTS.md")
    parser.add_argument("--worker", nargs=3, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        device, config, variant = args.worker
        worker(device, int(config), variant, args.runs)
        return 0
    devices = ["cpu"]
    gpu = gpu_device()
    if gpu:
        devices.append(gpu)
    else:
        print("GPU: skipped (CuPy or a GPU is not available)")
    rows = []
    for device in devices:
        for index, (label, _, batch) in enumerate(CONFIGS):
            results = in_processes(__file__, {v: [device, str(index), v]
                                              for v in ("plain", "fused")}, args.runs)
            (p_med, p_min), (f_med, f_min) = (med_min(results[v]["times"])
                                              for v in ("plain", "fused"))
            gain = (p_med - f_med) / p_med * 100
            rows.append(f"| {device} | {label}, batch {batch} | {p_med:.2f} | {p_min:.2f} | "
                        f"{f_med:.2f} | {f_min:.2f} | {gain:+.1f}% |")
            print(rows[-1], flush=True)
    lines = [
        "MQA character LM training step (forward + backward, float32), with and without "
        "`gather_slice_to_split`; each variant in processes of its own (3 rounds, taking "
        f"turns), {STEP_WARMUP} warm-up steps, {len(results['plain']['times'])} timed steps "
        "each. ONNX Runtime reports ~7% end-to-end for Falcon training from its "
        "GatherSliceToSplitFusion.",
        "",
        "| device | model | no Split fusion median ms | min ms | Split fusion median ms | "
        "min ms | gain (medians) |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
        *(["GPU: not run (no CuPy/GPU on this machine)."] if not gpu else []),
        f"Machine: {machine()}; numpy {np.__version__}.",
        f"Command: `{command_line('bench_training.py', argv)}`",
    ]
    publish(SECTION, lines, write=not args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())

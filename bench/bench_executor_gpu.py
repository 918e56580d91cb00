"""Executor on the GPU: GEMM throughput through the single GEMM entry point and one
FP16 training step of a transformer block, each side by side with its peer in one run.

- GEMM: the executor's FP16 GEMM (``executor.gemm.matmul`` with the FP16 policy in the path)
  against ``cupy.matmul`` on 2-D FP16 of the same size, the fastest FP16 GEMM CuPy has (its
  N-D matmul upcasts FP16 to SGEMM, so it is no peer for the batched rows). Rows: 2-D and
  3-D batched "original" (target >= 90% at n = 8192), the emulated "alternate" (target >= 85%
  at n = 8192, >= 75% at B*S = 16384 x 2048 x 2048), also with the weight's BF16 conversion
  cached (``Numerics.cache_weights``: converted once per training step, not once per GEMM).
- Training step: a Falcon-style block (LayerNorm, multi-query attention with the fused qkv
  split, GELU MLP, parallel residual) exported by PyTorch in FP16, turned into a training graph
  by graphopt and optimized, run by the executor (forward + backward, parameter gradients) vs
  PyTorch eager doing the same step on the same GPU; target <= 1.3x. Peak GPU memory of both.
  Needs torch with CUDA; without it the GEMM rows are still published.

On a machine without CuPy and a GPU it prints why it skipped and exits 0.

    python bench/bench_executor_gpu.py [--batch 16 --seq 1024 --hidden 2048] [--no-write]
"""
from __future__ import annotations

import argparse
import io
import sys
import time

from _common import machine, publish

SECTION = "Executor on GPU"


def gpu_or_reason():
    try:
        import cupy
        cupy.cuda.runtime.getDeviceCount()
        return cupy, None
    except Exception as exc:  # no CuPy, no driver, no device: all mean "skip"
        return None, f"{type(exc).__name__}: {exc}"


def timed(fn, cupy, repeats: int) -> float:
    """Median seconds of ``repeats`` synchronised runs after one warm-up."""
    fn()
    cupy.cuda.Device().synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        cupy.cuda.Device().synchronize()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def gemm_rows(cupy, sizes, repeats):
    """(label, peer TFLOP/s, executor TFLOP/s, ratio) per row; the peer is cupy.matmul on
    2-D FP16 operands of the same M x K x N (per batch entry for the batched rows)."""
    from graphopt.executor.gemm import matmul
    from graphopt.executor.numerics import Fp16Policy, Numerics, WeightGeneration

    def ctx(gemm, cached=None):
        class Ctx:
            xp = cupy
            numerics = Numerics("native", Fp16Policy(gemm=gemm), xp=cupy)
        if cached is not None:   # a weight read by many GEMMs of one step: converted once
            generation = WeightGeneration()
            Ctx.numerics.cache_weights(generation)
            generation.bump([cached])
        return Ctx

    def fp16(*shape):
        return cupy.random.standard_normal(shape, dtype=cupy.float32).astype(cupy.float16)

    cases = []
    for n in sizes:
        cases.append((f"2-D {n}^3, original", (n, n), (n, n), "original", 1))
        cases.append((f"3-D 4x{n}^3, original", (4, n, n), (4, n, n), "original", 4))
        cases.append((f"2-D {n}^3, alternate (emulated)", (n, n), (n, n), "alternate", 1))
        cases.append((f"2-D {n}^3, alternate (emulated), weight conversion cached",
                      (n, n), (n, n), "alternate+cache", 1))
    cases.append(("16384x2048x2048, alternate (emulated)", (16384, 2048), (2048, 2048),
                  "alternate", 1))
    cases.append(("16384x2048x2048, alternate (emulated), weight conversion cached",
                  (16384, 2048), (2048, 2048), "alternate+cache", 1))
    cases.append(("MQA scores 8x16 heads x512x64 @ shared K, original", (8, 16, 512, 64),
                  (8, 1, 64, 512), "original", 8 * 16))
    rows = []
    for label, shape_a, shape_b, gemm, count in cases:
        a, b = fp16(*shape_a), fp16(*shape_b)
        m, k = shape_a[-2:]
        n = shape_b[-1]
        flops = 2 * m * k * n * count
        a2, b2 = fp16(m, k), fp16(k, n)
        peer = timed(lambda a2=a2, b2=b2: cupy.matmul(a2, b2), cupy, repeats) / count
        context = ctx("alternate", b) if gemm == "alternate+cache" else ctx(gemm)
        ours = timed(lambda a=a, b=b, c=context: matmul(c, a, b), cupy, repeats)
        rows.append((label, flops / count / peer / 1e12, flops / ours / 1e12, peer * count / ours))
    return rows


def falcon_block(torch, hidden, heads):
    head_dim = hidden // heads

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.ln = torch.nn.LayerNorm(hidden)
            self.qkv = torch.nn.Linear(hidden, (heads + 2) * head_dim, bias=False)
            self.dense = torch.nn.Linear(hidden, hidden, bias=False)
            self.up = torch.nn.Linear(hidden, 4 * hidden)
            self.down = torch.nn.Linear(4 * hidden, hidden)

        def forward(self, x):
            b, s, _ = x.shape
            h = self.ln(x)
            fused = self.qkv(h).view(b, s, heads + 2, head_dim)
            q, k, v = fused[..., :-2, :], fused[..., [-2], :], fused[..., [-1], :]
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            scores = torch.softmax(q @ k.transpose(-1, -2) / head_dim ** 0.5, dim=-1)
            attn = (scores @ v).transpose(1, 2).reshape(b, s, hidden)
            mlp = self.down(torch.nn.functional.gelu(self.up(h)))
            return x + self.dense(attn) + mlp
    return Block()


def training_step_row(cupy, batch, seq, hidden, heads, repeats):
    import numpy as np
    import onnx
    import torch

    import graphopt
    from graphopt.executor import Session
    from graphopt.training import build_training_graph

    torch.manual_seed(0)
    block = falcon_block(torch, hidden, heads).cuda().half()
    x = torch.randn(batch, seq, hidden, device="cuda", dtype=torch.float16)
    g = torch.randn_like(x) * 1e-2
    buffer = io.BytesIO()
    torch.onnx.export(block, (x,), buffer, dynamo=False, opset_version=17,
                      input_names=["x"], output_names=["y"], do_constant_folding=False)
    forward = onnx.load_from_string(buffer.getvalue())
    built = build_training_graph(forward, loss="output")
    training, _ = graphopt.optimize(built.proto, level=2)
    session = Session(training, device="cuda", numerics="native")
    feeds = {"x": cupy.asarray(x.detach().cpu().numpy()),
             "y_grad": cupy.asarray(g.detach().cpu().numpy())}
    grad_names = list(built.grads.values())

    def ours():
        return session.run(feeds, output_names=grad_names)

    def theirs():
        block.zero_grad(set_to_none=True)
        block(x).backward(g)

    cupy.get_default_memory_pool().free_all_blocks()
    ours_s = timed(ours, cupy, repeats)
    ours_peak = cupy.get_default_memory_pool().total_bytes()
    torch.cuda.reset_peak_memory_stats()
    theirs_s = timed(lambda: (theirs(), torch.cuda.synchronize()), cupy, repeats)
    theirs_peak = torch.cuda.max_memory_allocated()
    check = ours()
    reference = {n: p.grad for n, p in block.named_parameters()}
    param = next(p for p in built.params if p in reference)
    name = built.grads[param]
    ours_grad = cupy.asnumpy(check[name]).astype(np.float32)
    torch_grad = reference[param].float().cpu().numpy()
    rel = float(np.abs(ours_grad - torch_grad).max() / (np.abs(torch_grad).max() + 1e-12))
    return ours_s, theirs_s, ours_peak, theirs_peak, name, rel


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[4096, 8192])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    cupy, reason = gpu_or_reason()
    if cupy is None:
        print(f"SKIP: executor GPU benchmark not run: {reason}")
        return 0
    device = cupy.cuda.runtime.getDeviceProperties(0)["name"]
    device = device.decode(errors="replace") if isinstance(device, bytes) else device
    lines = ["| GEMM | cupy.matmul 2-D TFLOP/s | executor TFLOP/s | ratio |",
             "|---|---|---|---|"]
    for label, peer, ours, ratio in gemm_rows(cupy, args.sizes, args.repeats):
        lines.append(f"| {label} | {peer:.1f} | {ours:.1f} | {ratio:.1%} |")
    print("\n".join(lines), flush=True)
    try:
        import torch  # noqa: F401 - the training-step peer
    except ImportError as exc:
        lines += ["", f"Training step not run: PyTorch is not importable ({exc})."]
    else:
        ours_s, theirs_s, ours_peak, theirs_peak, name, rel = training_step_row(
            cupy, args.batch, args.seq, args.hidden, args.heads, args.repeats)
        lines += [
            "", f"FP16 training step, Falcon-style block, batch {args.batch}, seq {args.seq}, "
            f"hidden {args.hidden}, {args.heads} heads:", "",
            "| runtime | step ms | peak GPU memory GiB |", "|---|---|---|",
            f"| graphopt executor (CuPy) | {ours_s * 1e3:.1f} | {ours_peak / 2**30:.2f} |",
            f"| PyTorch eager | {theirs_s * 1e3:.1f} | {theirs_peak / 2**30:.2f} |", "",
            f"executor / PyTorch = {ours_s / theirs_s:.2f} (target <= 1.3); gradient "
            f"'{name}' max relative difference {rel:.2e}."]
    lines += [f"Median of {args.repeats} runs after a warm-up. Machine: {machine()}, {device}.",
              "Command: `python bench/bench_executor_gpu.py`"]
    publish(SECTION, lines, write=not args.no_write)
    return 0


if __name__ == "__main__":
    sys.exit(main())

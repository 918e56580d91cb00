"""FP16 GEMM throughput of the numerics implementations.

GPU (default): square FP16 GEMMs at 4096 and 8192 on CuPy; TFLOP/s of plain
``cupy.matmul``, the alternate path (BF16 gemmEx, truncation and RNZ conversion) and the
emulated MI200 original (flush, matmul, flush); each as a ratio of ``cupy.matmul``
(target >= 85%). Writes its section of bench/RESULTS.md (see SECTION).
Without CuPy or a device it says so and exits 0.

CPU (``--cpu``): the NumPy implementations at small sizes, to show what the emulation costs
on the host. Baseline is the native original (cast to float32, BLAS sgemm, cast back);
NumPy's own float16 matmul (a non-BLAS loop) is shown once at the smallest size for scale.
Prints only; RESULTS.md is for the GPU numbers.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time

import numpy as np
from _common import RESULTS, write_section

SECTION = "FP16 GEMM on GPU"
TARGET_RATIO = 0.85


def tflops(n: int, seconds: float) -> float:
    return 2.0 * n**3 / seconds / 1e12


# -- GPU -------------------------------------------------------------------------------


def _cupy_or_reason():
    try:
        import cupy
    except Exception as exc:  # ImportError, or a wheel whose CUDA/ROCm libraries are missing
        return None, f"CuPy is not importable ({exc.__class__.__name__}: {exc})"
    try:
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None, "CuPy found no CUDA/ROCm device"
    except Exception as exc:
        return None, f"CuPy cannot reach a device ({exc})"
    return cupy, None


def _time_gpu(cp, fn, repeats: int) -> float:
    for _ in range(2):  # warm-up: kernel compilation, cuBLAS heuristics, memory pool
        fn()
    start, stop = cp.cuda.Event(), cp.cuda.Event()
    start.record()
    for _ in range(repeats):
        fn()
    stop.record()
    stop.synchronize()
    return cp.cuda.get_elapsed_time(start, stop) / 1e3 / repeats


def run_gpu(sizes, repeats):
    cp, reason = _cupy_or_reason()
    if cp is None:
        print(f"SKIP: FP16 GEMM GPU benchmark not run: {reason}. (Use --cpu for the host variant.)")
        return None
    from graphopt.executor.numerics.gpu_gemm import CupyFp16Gemm

    kernels = CupyFp16Gemm(cp)
    props = cp.cuda.runtime.getDeviceProperties(cp.cuda.Device().id)
    name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
    rows = []
    for n in sizes:
        rng = cp.random.default_rng(0)
        a = rng.standard_normal((n, n), dtype=cp.float32).astype(cp.float16)
        b = rng.standard_normal((n, n), dtype=cp.float32).astype(cp.float16)
        variants = {
            "cupy.matmul fp16": lambda a=a, b=b: cp.matmul(a, b),
            "original (FP16 gemmEx)": lambda a=a, b=b: kernels.original_native(a, b),
            "alternate (trunc)": lambda a=a, b=b: kernels.alternate(a, b, "truncate"),
            "alternate (RNZ)": lambda a=a, b=b: kernels.alternate(a, b, "rnz"),
            "emulated original (MI200 flush)": lambda a=a, b=b: kernels.original_mi200(a, b),
        }
        times = {label: _time_gpu(cp, fn, repeats) for label, fn in variants.items()}
        base = times["cupy.matmul fp16"]
        for label, seconds in times.items():
            rows.append((n, label, tflops(n, seconds), base / seconds))
        del a, b, variants  # the lambdas hold a and b too
        cp.get_default_memory_pool().free_all_blocks()
    header = f"device: {name}, CuPy {cp.__version__}, {'ROCm' if kernels.is_hip else 'CUDA'}"
    fp16_out = ("rocBLAS fp16_alt_impl flag (native gfx90a kernel)" if kernels.native_alternate
                else "emulated: FP16->BF16 kernel per operand, BF16 GEMM to float32, one cast")
    return header, fp16_out, rows


def format_gpu_table(header, fp16_out, rows):
    lines = [header, f"alternate: {fp16_out}", "",
             "| n | implementation | TFLOP/s | vs cupy.matmul | target |",
             "|---|---|---|---|---|"]
    for n, label, tf, ratio in rows:
        verdict = "" if label == "cupy.matmul fp16" else (
            "ok" if ratio >= TARGET_RATIO else f"below {TARGET_RATIO:.0%}")
        lines.append(f"| {n} | {label} | {tf:.1f} | {ratio:.1%} | {verdict} |")
    return "\n".join(lines)


# -- CPU -------------------------------------------------------------------------------


def _best_times_cpu(variants: dict, repeats: int) -> dict:
    """Best-of-N seconds per variant, measured round-robin so that a burst of load on a
    shared host hits every variant alike instead of skewing one of them."""
    for fn in variants.values():
        fn()  # warm-up
    best = dict.fromkeys(variants, float("inf"))
    for _ in range(repeats):
        for label, fn in variants.items():
            start = time.perf_counter()
            fn()
            best[label] = min(best[label], time.perf_counter() - start)
    return best


def run_cpu(sizes, repeats):
    from graphopt.executor.numerics import cpu_gemm

    rows = []
    for n in sizes:
        rng = np.random.default_rng(0)
        a = rng.standard_normal((n, n)).astype(np.float16)
        b = rng.standard_normal((n, n)).astype(np.float16)
        a32, b32 = a.astype(np.float32), b.astype(np.float32)
        variants = {
            "native original (f32 sgemm + casts)": lambda a=a, b=b: cpu_gemm.original_native(a, b),
            "float32 sgemm only (floor)": lambda a32=a32, b32=b32: np.matmul(a32, b32),
            "alternate (trunc)": lambda a=a, b=b: cpu_gemm.alternate(a, b, "truncate"),
            "alternate (RNZ)": lambda a=a, b=b: cpu_gemm.alternate(a, b, "rnz"),
            "emulated original (MI200 flush)": lambda a=a, b=b: cpu_gemm.original_mi200(a, b),
        }
        times = _best_times_cpu(variants, repeats)
        if n == min(sizes):  # ~0.5 s at 512 and cubic: once, for scale only
            times["numpy float16 matmul (no BLAS)"] = _best_times_cpu(
                {"fp16": lambda a=a, b=b: np.matmul(a, b)}, 1)["fp16"]
        base = times["native original (f32 sgemm + casts)"]
        for label, seconds in times.items():
            rows.append((n, label, seconds * 1e3, tflops(n, seconds) * 1e3, seconds / base))
    return rows


def format_cpu_table(rows):
    threads = os.environ.get("OPENBLAS_NUM_THREADS", "unset (all cores)")
    lines = [f"CPU: {platform.processor() or platform.machine()}, NumPy {np.__version__}, "
             f"OPENBLAS_NUM_THREADS={threads} (set it to 1 for steadier numbers on a shared host)",
             f"{'n':>5}  {'implementation':<36} {'ms':>9} {'GFLOP/s':>9} {'time vs native':>15}"]
    for n, label, ms, gflops, rel in rows:
        lines.append(f"{n:>5}  {label:<36} {ms:>9.2f} {gflops:>9.1f} {rel:>14.2f}x")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu", action="store_true", help="benchmark the NumPy path instead")
    parser.add_argument("--sizes", type=int, nargs="+", help="matrix sizes (square)")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--no-write", action="store_true", help="do not update RESULTS.md")
    args = parser.parse_args(argv)
    if args.cpu:
        rows = run_cpu(args.sizes or [512, 1024], args.repeats or 10)
        print(format_cpu_table(rows))
        return 0
    result = run_gpu(args.sizes or [4096, 8192], args.repeats or 20)
    if result is None:
        return 0
    table = format_gpu_table(*result)
    print(f"## {SECTION}")
    print(table)
    if not args.no_write:
        write_section(SECTION, table)
        print(f"\nwritten to {RESULTS}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

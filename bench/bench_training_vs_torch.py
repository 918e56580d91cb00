"""Training step (forward + backward) of the MQA example: graphopt executor vs PyTorch eager
on CPU, same weights, same batch, each in processes of its own (see _common for the
method), plus the extra memory each step needs. Writes its section of bench/RESULTS.md.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/bench_training_vs_torch.py

PyTorch is optional (never a dependency of graphopt): without it the script says so and
exits 0. About 1 minute on a quiet 2-core machine. A second part times the wider model's
forward products alone in each runtime (its own RESULTS.md section): whether a gap in the
step is the BLAS's or the executor's.

One step = for graphopt one run of the training graph (forward, YieldOp, backward, all
parameter gradients), for PyTorch ``loss.backward()`` from parameters whose ``.grad`` is
cleared: neither side runs an optimizer. The two losses are printed and must agree.
*Step memory*: the peak resident set during the warm-up and timed steps (``VmHWM``, reset
just before the first step) less the resident set before it.
"""
from __future__ import annotations

import argparse
import importlib.util
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
    rss_mb,
    time_calls,
    worker_report,
)

from graphopt.examples.mqa import MqaConfig, build_mqa_model

SECTION = "Training step vs PyTorch eager"
CONFIGS = {  # name: (label, model config, batch)
    "defaults": ("`--example mqa` defaults (hidden 64, 4 heads, seq 32, mlp 128)",
                 MqaConfig(vocab=56), 32),
    "wider": ("wider (hidden 256, 8 heads, seq 128, mlp 1024)",
              MqaConfig(vocab=56, seq=128, hidden=256, heads=8, mlp=1024), 8),
}
TARGETS = {"defaults": 1.5, "wider": 1.1}
PRODUCTS_SECTION = "Training step's matrix products: NumPy's BLAS vs PyTorch's"


def product_shapes(cfg: MqaConfig, batch: int) -> dict[str, tuple[int, int, int, int]]:
    """The forward products of the MQA model's step, (batch, M, K, N) as graphopt's executor
    runs them: the attention products with the query heads folded into the rows (one GEMM
    per sequence, executor/gemm.py), the projections on every token at once. Each backward
    product has the same M*K*N as one of these."""
    tokens = batch * cfg.seq
    return {
        "QKV projection": (1, tokens, cfg.hidden, (cfg.heads + 2) * cfg.head_dim),
        "attention scores": (batch, cfg.seq * cfg.heads, cfg.head_dim, cfg.seq),
        "attention context": (batch, cfg.seq * cfg.heads, cfg.seq, cfg.head_dim),
        "output projection": (1, tokens, cfg.hidden, cfg.hidden),
        "MLP up": (1, tokens, cfg.hidden, cfg.mlp),
        "MLP down": (1, tokens, cfg.mlp, cfg.hidden),
        "LM head": (1, tokens, cfg.hidden, cfg.vocab),
    }


def products_worker(runtime: str, runs: int) -> None:
    """Each forward product of the wider model's step, timed alone: NumPy's matmul (the
    executor's products call it) or PyTorch's, PyTorch's attention products as its model
    writes them (query heads against the one K/V head by broadcasting)."""
    _, cfg, batch = CONFIGS["wider"]
    rng = np.random.default_rng(0)
    extra = {}
    if runtime == "torch":
        import torch

        extra = {"threads": torch.get_num_threads(), "version": torch.__version__}
    per_product = {}
    for name, (b, m, k, n) in product_shapes(cfg, batch).items():
        a = rng.standard_normal((b, m, k), np.float32)
        w = rng.standard_normal((b, k, n), np.float32)
        if b == 1:
            a, w = a[0], w[0]
        if runtime == "torch":
            if b > 1:  # (b, heads, seq, K) against (b, 1, K, N), as in torch_step
                a = a.reshape(b, cfg.heads, cfg.seq, k)
                w = w.reshape(b, 1, k, n)
            ta, tw = torch.from_numpy(a), torch.from_numpy(w)
            per_product[name] = time_calls(lambda ta=ta, tw=tw: torch.matmul(ta, tw), runs, 3)
        else:
            per_product[name] = time_calls(lambda a=a, w=w: np.matmul(a, w), runs, 3)
    totals = [sum(t[i] for t in per_product.values()) for i in range(runs)]
    worker_report(totals, products=per_product, **extra)


def _batch(cfg: MqaConfig, batch: int):
    rng = np.random.default_rng(0)
    return (rng.integers(0, cfg.vocab, (batch, cfg.seq)),
            rng.integers(0, cfg.vocab, (batch, cfg.seq)))


def graphopt_step(cfg: MqaConfig, batch: int):
    from graphopt.executor import Session
    from graphopt.trainer import build

    graph = build(build_mqa_model(cfg), loss="cross_entropy", labels="labels")
    session = Session(graph.proto, device="cpu")
    ids, labels = _batch(cfg, batch)
    feeds = {"input_ids": ids, "labels": labels, **graph.initial}
    fetches = graph.losses + list(graph.grads.values())

    def step():
        return float(session.run(feeds, fetches)[graph.losses[0]])

    return step


def torch_step(cfg: MqaConfig, batch: int):
    """The same model in PyTorch, weights taken from the ONNX model's initializers."""
    import torch
    import torch.nn.functional as F
    from onnx import numpy_helper

    model = build_mqa_model(cfg)
    w = {i.name: torch.tensor(numpy_helper.to_array(i), requires_grad=True)
         for i in model.graph.initializer}
    heads, head_dim, hidden = cfg.heads, cfg.head_dim, cfg.hidden
    mask = torch.triu(torch.full((cfg.seq, cfg.seq), -1e4), diagonal=1)
    ids, labels = (torch.from_numpy(a) for a in _batch(cfg, batch))

    def ln(x, prefix):
        return F.layer_norm(x, (hidden,), w[f"{prefix}.weight"], w[f"{prefix}.bias"], 1e-5)

    def forward():
        b, t = ids.shape
        x = w["embed.weight"][ids] + w["embed.positions"]
        fused = (ln(x, "ln_attn") @ w["attn.query_key_value.weight"]).view(
            b, t, heads + 2, head_dim)
        q = fused[:, :, :-2].transpose(1, 2)                  # b, h, t, d
        k = fused[:, :, -2:-1].permute(0, 2, 3, 1)            # b, 1, d, t
        v = fused[:, :, -1:].transpose(1, 2)                  # b, 1, t, d
        probs = torch.softmax(q @ k / np.float32(np.sqrt(head_dim)) + mask, dim=-1)
        context = (probs @ v).transpose(1, 2).reshape(b, t, hidden)
        x = x + context @ w["attn.dense.weight"]
        up = ln(x, "ln_mlp") @ w["mlp.up.weight"] + w["mlp.up.bias"]
        x = x + F.gelu(up) @ w["mlp.down.weight"] + w["mlp.down.bias"]
        logits = ln(x, "ln_final") @ w["lm_head.weight"] + w["lm_head.bias"]
        return F.cross_entropy(logits.reshape(-1, cfg.vocab), labels.reshape(-1))

    def step():
        for p in w.values():
            p.grad = None
        loss = forward()
        loss.backward()
        return float(loss)

    return step


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM, the peak resident set
        return True
    except OSError:
        return False


def _peak_rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    return float("nan")


def worker(runtime: str, config: str, runs: int) -> None:
    if config == "products":
        products_worker(runtime, runs)
        return
    _, cfg, batch = CONFIGS[config]
    extra = {}
    if runtime == "torch":
        import torch

        extra = {"threads": torch.get_num_threads(), "version": torch.__version__}
    else:
        from graphopt.executor import describe_compiled_kernels

        extra = {"kernels": describe_compiled_kernels()}
    step = (torch_step if runtime == "torch" else graphopt_step)(cfg, batch)
    before = rss_mb()
    setup_peak = _peak_rss_mb()  # the libraries, the model, the set-up
    reset = _reset_peak_rss()
    losses = []
    times = time_calls(lambda: losses.append(step()), runs, warmup=STEP_WARMUP)
    step_peak = _peak_rss_mb()
    step_mb = step_peak - before if reset else float("nan")
    worker_report(times, loss=losses[-1], step_mb=step_mb,
                  process_mb=max(setup_peak, step_peak), **extra)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=MIN_RUNS)
    parser.add_argument("--no-write", action="store_true", help="do not update bench/RESULTS.md")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(*args.worker, args.runs)
        return 0
    if importlib.util.find_spec("torch") is None:
        print("bench_training_vs_torch: skipped: PyTorch is not installed in this environment "
              "(pip install torch in a venv of its own; it is not a graphopt dependency)")
        return 0
    rows = []
    for name, (label, _, batch) in CONFIGS.items():
        results = in_processes(__file__, {rt: [rt, name] for rt in ("graphopt", "torch")},
                               args.runs)
        ours, theirs = results["graphopt"], results["torch"]
        loss_ours, loss_torch = ours["loss"][0], theirs["loss"][0]
        if not np.isclose(loss_ours, loss_torch, rtol=1e-4):
            raise SystemExit(f"{name}: losses differ: graphopt {loss_ours}, torch {loss_torch}")
        (o_med, o_min), (t_med, t_min) = med_min(ours["times"]), med_min(theirs["times"])
        mem_o, mem_t = max(ours["step_mb"]), max(theirs["step_mb"])
        whole_o, whole_t = max(ours["process_mb"]), max(theirs["process_mb"])
        rows.append(f"| {label}, batch {batch} | {o_med:.2f} | {o_min:.2f} | {t_med:.2f} | "
                    f"{t_min:.2f} | {o_med / t_med:.2f}x ({o_min / t_min:.2f}x) | "
                    f"<= {TARGETS[name]}x | {mem_o:.1f} | {mem_t:.1f} | "
                    f"{whole_o:.0f} | {whole_t:.0f} | "
                    f"{loss_ours:.6f} / {loss_torch:.6f} |")
        print(rows[-1], flush=True)
    runs = len(ours["times"])
    lines = [
        "MQA character LM (`graphopt.examples.mqa`), float32, one training step (forward + "
        "backward, every parameter gradient, no optimizer) with the same weights and batch. "
        f"Each runtime in processes of its own (3 rounds, taking turns), {STEP_WARMUP} warm-up "
        f"steps, {runs} timed steps each; ratio = graphopt / PyTorch of the medians (of the "
        "minimums). Step MiB: "
        "peak resident set during the steps less the resident set before them (largest of "
        "the rounds); process peak MiB: the whole process's peak resident set (Python, the "
        "libraries each runtime loads -- numba's compiled kernels for graphopt, about 110 "
        "MiB of it --, the model and the steps).",
        "",
        "| model | graphopt median ms | min ms | PyTorch eager median ms | min ms | ratio | "
        "target | graphopt step MiB | PyTorch step MiB | graphopt process peak MiB | "
        "PyTorch process peak MiB | loss graphopt / PyTorch |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"Machine: {machine()}; numpy {np.__version__}, PyTorch {theirs['version'][0]} "
        f"({theirs['threads'][0]} threads); BLAS in the graphopt workers: {ours['blas'][0]}; "
        f"graphopt's float32 row and activation kernels: {ours['kernels'][0]}.",
        f"Command: `{command_line('bench_training_vs_torch.py', argv)}` (with PyTorch "
        "installed, e.g. in a venv of its own)",
    ]
    publish(SECTION, lines, write=not args.no_write)
    compare_products(args.runs, argv, write=not args.no_write)
    return 0


def compare_products(runs: int, argv, write: bool) -> None:
    """The wider step's forward products, each runtime in processes of its own: is the gap
    in the products the BLAS's or the executor's?"""
    results = in_processes(__file__, {rt: [rt, "products"] for rt in ("graphopt", "torch")},
                           runs)
    ours, theirs = results["graphopt"], results["torch"]
    _, cfg, batch = CONFIGS["wider"]
    rows = []
    for name, (b, m, k, n) in product_shapes(cfg, batch).items():
        o_times = [t for report in ours["products"] for t in report[name]]
        t_times = [t for report in theirs["products"] for t in report[name]]
        (o_med, o_min), (t_med, t_min) = med_min(o_times), med_min(t_times)
        shape = f"{b} x ({m} x {k}) @ ({k} x {n})" if b > 1 else f"({m} x {k}) @ ({k} x {n})"
        rows.append(f"| {name} | {shape} | {o_med:.2f} | {o_min:.2f} | {t_med:.2f} | "
                    f"{t_min:.2f} | {o_med / t_med:.2f}x |")
    (o_med, o_min), (t_med, t_min) = med_min(ours["times"]), med_min(theirs["times"])
    rows.append(f"| all of them | | {o_med:.2f} | {o_min:.2f} | {t_med:.2f} | {t_min:.2f} | "
                f"{o_med / t_med:.2f}x |")
    lines = [
        f"The forward products of the wider model's training step (batch {batch}, float32), "
        "each timed alone, NumPy's `matmul` (the call graphopt's executor makes) against "
        "`torch.matmul`, each runtime in processes of its own (3 rounds, taking turns), "
        f"warm-up, {len(ours['times'])} timed calls each. Rows: the executor's shapes, the "
        f"attention products with the {cfg.heads} query heads folded into the rows against "
        "the one K/V head; PyTorch gets them as its model writes them, "
        f"({batch}, {cfg.heads}, {cfg.seq}, K) against ({batch}, 1, K, N). Each backward "
        "product makes as many multiply-adds as one of these.",
        "",
        "| product | shape | NumPy median ms | min ms | PyTorch median ms | min ms | "
        "NumPy / PyTorch |",
        "|---|---|---|---|---|---|---|",
        *rows,
        "",
        f"Machine: {machine()}; numpy {np.__version__} ({ours['blas'][0]}); PyTorch "
        f"{theirs['version'][0]} ({theirs['threads'][0]} threads).",
        f"Command: `{command_line('bench_training_vs_torch.py', argv)}` (this section is its "
        "second part)",
    ]
    publish(PRODUCTS_SECTION, lines, write=write)


if __name__ == "__main__":
    sys.exit(main())

"""Training at model size: `graphopt run` against PyTorch eager on Hugging Face models of 118M
to 1.1B parameters, the same model, the same starting weights and the same batch on each side,
each side in a process of its own.

Models (random weights built from `transformers` configs as `bench_scale.py` builds them, seed
0, eager attention, no cache, `model.eval()`: no dropout) and their default exports:
`falcon-118m` TorchScript (`ts`: opset 17, dynamic batch and sequence, weights inline),
`gpt2-124m` dynamo (`dynamo`: opset 18, external data), `falcon-1.1b` (hidden 2048, 32 heads,
24 layers, multi-query, vocabulary 65024) TorchScript (beyond 2 GB: one file per tensor, as
torch writes it). `tiny-falcon` and `tiny-gpt2` (hidden 64, 4 heads, 2 layers, vocabulary
512) are for quick checks, not in the default set. `--models` alone runs each model with its
default export; with `--exports` every model runs with every export given.

Exports: each in a process of its own into `--cache` (default `$GRAPHOPT_BENCH_CACHE` or
`~/.cache/graphopt-bench`), `training/<model>-<export>/`, kept for later runs. Before the
export every parameter whose values are all equal (a fresh model's LayerNorm weights, 1, and
biases, 0) gets `+ 0.02 * randn` from a torch.Generator seeded 2, in the order of
`model.named_parameters()`: exporters merge initializers of equal values, which would leave
graphopt training fewer tensors than PyTorch. `--no-perturb` exports the models as built
(`training/<model>-<export>-unperturbed/`) to show that trap (graphopt's `--split-shared`,
passed with `--graphopt-args`, undoes it). The PyTorch side never reads weights back from
the ONNX: it rebuilds the model from the seed and the same perturbation and checks them
against a fingerprint the export stored (sum and sum of squares over all parameters). The
batch, `data-<B>x<S>.npz` in the same folder: `input_ids` int64 [B, S] (uniform random ids,
numpy seed 1) and `labels` = `input_ids` shifted left by one, the last position -100.

One step, each side: forward, loss, backward, optimizer step on the same batch every step.
graphopt: `graphopt run model.onnx --data D --loss cross_entropy --labels labels --batch-size
B --steps N --optimizer O --lr LR --weight-decay WD --log steps.jsonl` (plus
`--graphopt-args`), run by graphopt's own environment (`--graphopt-python`, default
`<repo>/.venv/bin/python`) with `-P`, from a folder outside the repository; the step seconds
and losses from the log, the trained tensors and weights from its "training N tensors (W
weights)" line. PyTorch: a child process of this script, `loss =
CrossEntropyLoss(ignore_index=-100)(logits.reshape(-1, V), labels.reshape(-1))`,
`optimizer.zero_grad(set_to_none=True); loss.backward(); optimizer.step()`, each step timed
with `time.perf_counter`; its trained tensors and weights are `model.parameters()` (a tied
weight counted once). Optimizers (`--optimizer`, default both, each its own pair of runs;
models over 500M parameters with SGD only unless `--large-adamw`: AdamW's two moments would
take PyTorch's 1.1B step past a 24 GB machine): SGD without momentum, weight decay 0, lr 1e-2
(`--lr`): 0.1 does not diverge on random models
but is no steady descent either (a 4-layer, 256-wide GPT-2 with GPT-2's vocabulary went 10.43
-> 10.50 at its 4th step), and each such jump magnifies the two sides' float32 rounding, which
the 1e-5 comparison would then measure instead of the training; at 1e-2 the loss falls every
step. AdamW as `torch.optim.AdamW`'s defaults (betas 0.9/0.999, eps 1e-8, weight decay 0.01,
graphopt's adamw default too) with transformers' Trainer's groups (no decay on tensors of rank
< 2, as graphopt's default), lr 1e-4.

Steps: `--steps` (default 10 for models under 500M parameters, 4 for larger): the first is the
warm-up, the median and the minimum of the others are reported (the benchmarks' method: at least 9
timed runs, or 3 where a run takes over 10 s; a run with fewer says so). Peak RSS: `/usr/bin/
time -v`'s maximum resident set of each process, from start to exit (MB = 10^6 bytes); the
PyTorch child's VmHWM is printed too. A run that fails, runs past `--timeout` (default 3600 s)
or holds more than `--memory-limit` GB is its cell's entry.

Falcon's dynamo export keeps the rotary embedding's `inv_freq` buffer as an initializer;
graphopt leaves it out by default, as a module buffer reached only through Cos and Sin, so both
sides train the same tensors.

Targets: graphopt's peak RSS <= 1.1x PyTorch's; its median step <= PyTorch's
(falcon-118m and gpt2-124m only); SGD: losses equal to 1e-5 (absolute) over the first 5 steps;
AdamW: the first step's loss equal to 1e-5, the later ones within 1e-3 relative.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python \\
        bench/bench_training_scale.py [--models falcon-118m gpt2-124m falcon-1.1b] \\
        [--exports ts dynamo] [--optimizer sgd adamw] [--batch B] [--seq 128] [--steps N] \\
        [--lr LR] [--graphopt-args "--untie"] [--no-perturb] [--large-adamw] [--timeout 3600] \\
        [--memory-limit GB] [--cache DIR] [--graphopt-python PY] [--build-only] [--no-write]

The interpreter running it needs torch, transformers, onnx and threadpoolctl (torch and
transformers are imported by the export and PyTorch processes only); graphopt's environment
needs graphopt only. Writes the section "Training at model size" of bench/RESULTS.md (unless
`--no-write`; refused on a loaded machine: each timed process starts once the 1-minute load
average is at most 1 per core, waiting up to 4 minutes for the previous one to leave it, and
a start above that refuses the section, see _common.settle).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import MIN_RUNS, bench_env, command_line, machine, publish, settle
from bench_scale import (
    _FALCON,
    BATCH,
    LONG_RUN_S,
    LONG_RUNS,
    MB,
    SEED,
    ModelSpec,
    Run,
    _mem_available,
    check_graphopt_runs,
    export_real,
    logits_only,
    model_stats,
    timed,
    torch_model,
)
from bench_scale import SEQ as EXPORT_SEQ

SECTION = "Training at model size"
HERE = Path(__file__).resolve()
REPO = HERE.parent.parent

PERTURB_SEED = SEED + 2
PERTURB_SCALE = 0.02
DATA_SEED = SEED + 1
LARGE_PARAMS = 500e6  # models this large default to SMALL_STEPS steps
STEPS, SMALL_STEPS = 10, 4
EXPORT_TIMEOUT_S = 4 * 3600
EXPORTS = ("ts", "dynamo")
OPTIMIZERS = ("sgd", "adamw")
LR = {"sgd": 1e-2, "adamw": 1e-4}
WEIGHT_DECAY = {"sgd": 0.0, "adamw": 0.01}
ADAMW = dict(betas=(0.9, 0.999), eps=1e-8)
IGNORE = -100
FAILURE_CHARS = 300

# targets
RSS_RATIO = 1.1
TIME_TARGET_MODELS = ("falcon-118m", "gpt2-124m")
SGD_STEPS, SGD_ABS = 5, 1e-5
FIRST_ABS, ADAMW_REL = 1e-5, 1e-3

_TINY = dict(vocab_size=512, hidden_size=64, num_attention_heads=4, num_hidden_layers=2)
MODELS: dict[str, tuple[ModelSpec, str]] = {  # name: (spec, default export)
    "falcon-118m": (ModelSpec("falcon", dict(vocab_size=32000, hidden_size=1024,
                                             num_attention_heads=16, num_hidden_layers=8,
                                             **_FALCON)), "ts"),
    "gpt2-124m": (ModelSpec("gpt2", {}), "dynamo"),
    "falcon-1.1b": (ModelSpec("falcon", dict(vocab_size=65024, hidden_size=2048,
                                             num_attention_heads=32, num_hidden_layers=24,
                                             **_FALCON)), "ts"),
    "tiny-falcon": (ModelSpec("falcon", dict(**_TINY, **_FALCON)), "ts"),
    "tiny-gpt2": (ModelSpec("gpt2", dict(vocab_size=512, n_embd=64, n_head=4, n_layer=2)),
                  "dynamo"),
}
DEFAULT_MODELS = ("falcon-118m", "gpt2-124m", "falcon-1.1b")
# sequences per step without --batch: the 1.1B Falcon as the target has it (batch 1 x 128, on
# a 24 GB machine), the others 4
DEFAULT_BATCH, MODEL_BATCH = 4, {"falcon-1.1b": 1}


def optimizers_for(args, case) -> list[str]:
    """The optimizers a model runs with: models of LARGE_PARAMS or more with SGD only unless
    --large-adamw (AdamW's two moments add 8 bytes a weight, 9 GB on the 1.1B Falcon: PyTorch's
    step would no longer fit a 24 GB machine)."""
    large = case.info is not None and case.info["params"] >= LARGE_PARAMS
    if large and not args.large_adamw:
        return [o for o in args.optimizer if o == "sgd"]
    return list(args.optimizer)


def batch_size(args, model: str) -> int:
    return args.batch if args.batch is not None else MODEL_BATCH.get(model, DEFAULT_BATCH)


def batch_words(args) -> str:
    if args.batch is not None:
        return str(args.batch)
    models = args.models or list(DEFAULT_MODELS)
    special = [f"{m} {MODEL_BATCH[m]}" for m in models if m in MODEL_BATCH]
    return f"{DEFAULT_BATCH}" + (f"; {', '.join(special)}" if special else "")


# ---- the model on the PyTorch side (export and training processes) --------------------------
def built_model(name: str, perturb: bool):
    """MODELS[name] as bench_scale builds it, every all-equal parameter perturbed (unless
    ``perturb`` is false); returns (model, {"perturbed": [names], "fingerprint": [sum,
    sum of squares]})."""
    import torch

    model = torch_model(MODELS[name][0])
    perturbed = []
    if perturb:
        generator = torch.Generator().manual_seed(PERTURB_SEED)
        with torch.no_grad():
            for pname, param in model.named_parameters():  # tied weights once
                flat = param.reshape(-1)
                if flat.numel() and bool((flat == flat[0]).all()):
                    param.add_(PERTURB_SCALE * torch.randn(param.shape, generator=generator))
                    perturbed.append(pname)
    return model, {"perturbed": perturbed, "fingerprint": fingerprint(model)}


def fingerprint(model) -> list[float]:
    import torch

    with torch.no_grad():
        values = [p.detach().double() for p in model.parameters()]
        return [float(sum(v.sum() for v in values)), float(sum(v.square().sum() for v in values))]


def export_child(name: str, kind: str, dest: str, perturb: bool) -> None:
    import onnx
    import torch

    start = time.perf_counter()
    model, built = built_model(name, perturb)
    wrapper = logits_only(model)
    ids = torch.randint(0, model.config.vocab_size, (BATCH, EXPORT_SEQ),
                        generator=torch.Generator().manual_seed(SEED + 1))
    path = os.path.join(dest, "model.onnx")
    export_real(wrapper, ids, kind, path)
    proto = onnx.load(path, load_external_data=False)
    params = list(model.parameters())
    info = {"model": name, "export": kind, "perturb": perturb,
            "seconds": time.perf_counter() - start, "vocab": model.config.vocab_size,
            "params": sum(p.numel() for p in params), "tensors": len(params),
            "initializers": len(proto.graph.initializer), **built, **model_stats(path)}
    Path(dest, "export.json").write_text(json.dumps(info, indent=1) + "\n")


def torch_child(name: str, folder: str, data: str, optimizer: str, lr: float, steps: int,
                perturb: bool) -> None:
    """Train MODELS[name] as the export's weights start, on the stored batch; print one JSON
    line: losses, step seconds, peak RSS (VmHWM), trained tensors and weights, threads."""
    import numpy as np
    import torch

    stored = json.loads(Path(folder, "export.json").read_text())
    model, built = built_model(name, perturb)
    if built["fingerprint"] != stored["fingerprint"]:
        raise SystemExit(f"the rebuilt weights differ from the export's: fingerprint "
                         f"{built['fingerprint']}, the export's {stored['fingerprint']}")
    wrapper = logits_only(model)  # eval(): no dropout, as exported
    params = list(model.parameters())
    for param in params:
        param.requires_grad_(True)
    batch = np.load(data)
    ids = torch.from_numpy(batch["input_ids"])
    labels = torch.from_numpy(batch["labels"]).reshape(-1)
    vocab = model.config.vocab_size
    criterion = torch.nn.CrossEntropyLoss(ignore_index=IGNORE)
    if optimizer == "sgd":
        opt = torch.optim.SGD(params, lr=lr, momentum=0.0, weight_decay=WEIGHT_DECAY["sgd"])
    else:
        # transformers' Trainer's groups, graphopt's default: no decay on biases and norms
        groups = [{"params": [p for p in params if p.ndim >= 2]},
                  {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
        opt = torch.optim.AdamW(groups, lr=lr, weight_decay=WEIGHT_DECAY["adamw"], **ADAMW)
    losses, seconds = [], []
    for _ in range(steps):
        start = time.perf_counter()
        loss = criterion(wrapper(ids).reshape(-1, vocab), labels)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        seconds.append(time.perf_counter() - start)
        losses.append(float(loss.detach()))
    print(json.dumps({"losses": losses, "seconds": seconds, "vmhwm_bytes": _vmhwm(),
                      "tensors": len(params), "weights": sum(p.numel() for p in params),
                      "threads": torch.get_num_threads(), "torch": torch.__version__,
                      "mkl": torch.backends.mkl.is_available()}))


def _vmhwm() -> int | None:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return None


# ---- the benchmark ----------------------------------------------------------------------------
@dataclasses.dataclass
class Side:
    """One side's run of one case and optimizer."""
    losses: list[float] = dataclasses.field(default_factory=list)
    seconds: list[float] = dataclasses.field(default_factory=list)
    rss: int | None = None
    wall_s: float | None = None
    tensors: int | None = None
    weights: int | None = None
    notes: list[str] = dataclasses.field(default_factory=list)
    failure: str | None = None
    vmhwm: int | None = None  # PyTorch's own peak (VmHWM)
    runtime: str = ""  # PyTorch's version and threads

    @property
    def ok(self) -> bool:
        return self.failure is None and bool(self.losses)

    @property
    def timed(self) -> list[float]:
        return self.seconds[1:]  # the first step is the warm-up


@dataclasses.dataclass
class Case:
    model: str
    export: str
    folder: Path
    info: dict | None
    failure: str | None = None

    @property
    def label(self) -> str:
        return f"{self.model} {self.export}"


TRAINED = re.compile(r"training (\d+) tensors \(([\d,]+) weights\)")


def failure(run: Run, folder: Path) -> str | None:
    """``run.failure``, a failed exit with the last line of its stderr at more length than
    ``timed`` keeps."""
    if run.failure is None or not run.failure.startswith("failed (exit"):
        return run.failure
    try:
        lines = [line.strip() for line in (folder / "stderr.txt").read_text().splitlines()
                 if line.strip()]
    except OSError:
        return run.failure
    status = run.failure.split(")", 1)[0] + ")"
    return f"{status}: {lines[-1][:FAILURE_CHARS]}" if lines else run.failure


def parse_graphopt(run: Run, log: Path, side: Side) -> None:
    side.rss, side.wall_s = run.rss_bytes, run.seconds
    for line in run.stdout.splitlines():
        found = TRAINED.search(line)
        if found:
            side.tensors, side.weights = int(found[1]), int(found[2].replace(",", ""))
        elif line.startswith("note:"):
            side.notes.append(line[len("note:"):].strip())
    if log.exists():
        records = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
        side.losses = [float(r["loss"]) for r in records]
        side.seconds = [float(r["seconds"]) for r in records]
    if side.failure is None and not side.losses:
        side.failure = "wrote no step log"


class Bench:
    def __init__(self, args):
        self.args = args
        self.root = Path(args.cache).expanduser() / "training"
        self.scratch = self.root / "runs"
        self.scratch.mkdir(parents=True, exist_ok=True)
        self.memory_limit = args.memory_limit * 1e9

    # -- exports and data --
    def case(self, model: str, export: str) -> Case:
        suffix = "" if self.args.perturb else "-unperturbed"
        folder = self.root / f"{model}-{export}{suffix}"
        case = Case(model, export, folder, None)
        if not (folder / "export.json").exists():
            case.failure = self.build(case)
            if case.failure:
                return case
        case.info = json.loads((folder / "export.json").read_text())
        return case

    def build(self, case: Case) -> str | None:
        partial = case.folder.with_name(case.folder.name + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        print(f"exporting {case.label} into {case.folder} ...", flush=True)
        command = [sys.executable, str(HERE), "--export-child", case.model, case.export,
                   str(partial)] + ([] if self.args.perturb else ["--no-perturb"])
        run = timed(command, str(partial), EXPORT_TIMEOUT_S, self.memory_limit)
        if run.failure:
            tail = Path(partial, "stderr.txt").read_text().strip().splitlines()[-15:]
            print(f"  export {run.failure}\n" + "\n".join(tail), flush=True)
            return f"export {run.failure}"
        for log in ("stdout.txt", "stderr.txt", "time-v.txt"):
            os.replace(partial / log, partial / f"export-{log}")
        os.replace(partial, case.folder)
        info = json.loads((case.folder / "export.json").read_text())
        print(f"  {run.seconds:.0f} s, peak RSS {(run.rss_bytes or 0) / MB:,.0f} MB; "
              f"{info['params'] / 1e6:,.1f}M parameters in {info['tensors']} tensors "
              f"({len(info['perturbed'])} perturbed), {info['initializers']} initializers, "
              f"{info['nodes']} nodes, {info['file_bytes'] / MB:,.0f} MB", flush=True)
        return None

    def data(self, case: Case) -> Path:
        """The batch, ``data-<B>x<S>.npz`` in the case's folder (made once)."""
        import numpy as np

        batch, seq = batch_size(self.args, case.model), self.args.seq
        path = case.folder / f"data-{batch}x{seq}.npz"
        if not path.exists():
            rng = np.random.default_rng(DATA_SEED)
            ids = rng.integers(0, case.info["vocab"], (batch, seq), dtype=np.int64)
            labels = np.full_like(ids, IGNORE)
            labels[:, :-1] = ids[:, 1:]
            partial = path.with_name(path.stem + ".partial.npz")
            np.savez(partial, input_ids=ids, labels=labels)
            os.replace(partial, path)
        return path

    def steps(self, case: Case) -> int:
        if self.args.steps:
            return self.args.steps
        return STEPS if case.info["params"] < LARGE_PARAMS else SMALL_STEPS

    # -- one side's run --
    def graphopt_command(self, case: Case, data: Path, optimizer: str, log: Path) -> list[str]:
        args = self.args
        return [args.graphopt_python, "-P", "-m", "graphopt", "run",
                str(case.folder / "model.onnx"), "--data", str(data),
                "--loss", "cross_entropy", "--labels", "labels",
                "--batch-size", str(batch_size(args, case.model)),
                "--steps", str(self.steps(case)),
                "--optimizer", optimizer, "--lr", f"{self.lr(optimizer):g}",
                "--weight-decay", f"{WEIGHT_DECAY[optimizer]:g}", "--log", str(log),
                # the class axis is ambiguous where the sequence is as long as the vocabulary
                *(["--class-axis", "2"] if args.seq == case.info["vocab"] else []),
                *shlex.split(args.graphopt_args)]

    def torch_command(self, case: Case, data: Path, optimizer: str) -> list[str]:
        return [sys.executable, str(HERE), "--torch-child", case.model, str(case.folder),
                str(data), optimizer, f"{self.lr(optimizer)!r}", str(self.steps(case))] + \
            ([] if self.args.perturb else ["--no-perturb"])

    def lr(self, optimizer: str) -> float:
        return self.args.lr if self.args.lr is not None else LR[optimizer]

    def run_graphopt(self, case: Case, optimizer: str) -> Side:
        side = Side()
        folder = Path(tempfile.mkdtemp(prefix="graphopt-", dir=self.scratch))
        try:
            log = folder / "steps.jsonl"
            run = timed(self.graphopt_command(case, self.data(case), optimizer, log),
                        str(folder), self.args.timeout, self.memory_limit)
            side.failure = failure(run, folder)
            parse_graphopt(run, log, side)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        return side

    def run_torch(self, case: Case, optimizer: str) -> Side:
        side = Side()
        folder = Path(tempfile.mkdtemp(prefix="torch-", dir=self.scratch))
        try:
            run = timed(self.torch_command(case, self.data(case), optimizer), str(folder),
                        self.args.timeout, self.memory_limit)
            side.failure = failure(run, folder)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        side.rss, side.wall_s = run.rss_bytes, run.seconds
        if run.failure is None:
            try:
                report = json.loads(run.stdout.strip().splitlines()[-1])
            except (IndexError, ValueError):
                side.failure = "printed no report"
                return side
            side.losses, side.seconds = report["losses"], report["seconds"]
            side.tensors, side.weights = report["tensors"], report["weights"]
            side.vmhwm = report["vmhwm_bytes"]
            side.runtime = (f"torch {report['torch']}, {report['threads']} threads, MKL "
                            f"{'yes' if report['mkl'] else 'no'}")
        return side


# ---- the report -------------------------------------------------------------------------------
def _fmt_rss(side: Side) -> str:
    return f"{side.rss / MB:,.0f}" if side.rss else "-"


def _fmt_times(side: Side) -> str:
    if not side.ok:
        return side.failure or "no steps"
    if not side.timed:
        return "no timed step"
    return f"{statistics.median(side.timed):.3f} / {min(side.timed):.3f}"


def _fmt_trained(side: Side) -> str:
    if side.tensors is None:
        return "-"
    return f"{side.tensors} / {side.weights:,}"


def _ratio(a: float | None, b: float | None) -> str:
    return f"{a / b:.2f}x" if a and b else "-"


def loss_diffs(ours: Side, torch: Side) -> list[tuple[float, float]]:
    """(|difference|, |difference| / |PyTorch's|) per step both sides ran."""
    return [(abs(a - b), abs(a - b) / abs(b) if b else float("inf"))
            for a, b in zip(ours.losses, torch.losses, strict=False)]


def targets(model: str, optimizer: str, ours: Side, torch: Side
            ) -> list[tuple[str, bool | None, str]]:
    """(target, met or None when it cannot be judged, figures) for one pair of runs."""
    found = []
    for who, side in (("graphopt", ours), ("PyTorch", torch)):
        if not side.ok:
            found.append((f"{who} runs", False, side.failure or "no steps"))
    if not (ours.ok and torch.ok):
        return found
    if ours.rss and torch.rss:
        found.append((f"peak RSS <= {RSS_RATIO:g}x PyTorch's", ours.rss <= RSS_RATIO * torch.rss,
                      f"{ours.rss / MB:,.0f} vs {torch.rss / MB:,.0f} MB, "
                      f"{ours.rss / torch.rss:.2f}x"))
    else:
        found.append((f"peak RSS <= {RSS_RATIO:g}x PyTorch's", None, "no figure"))
    if model in TIME_TARGET_MODELS:
        if ours.timed and torch.timed:
            a, b = statistics.median(ours.timed), statistics.median(torch.timed)
            found.append(("step <= PyTorch's", a <= b, f"{a:.3f} vs {b:.3f} s, {a / b:.2f}x"))
        else:
            found.append(("step <= PyTorch's", None, "no figure"))
    diffs = loss_diffs(ours, torch)
    if not diffs:
        found.append(("losses", None, "no losses on one side"))
        return found
    if optimizer == "sgd":
        window = diffs[:SGD_STEPS]
        worst = max(d for d, _ in window)
        short = f"; only {len(window)} steps" if len(window) < SGD_STEPS else ""
        found.append((f"SGD losses equal to {SGD_ABS:g} over {SGD_STEPS} steps",
                      worst <= SGD_ABS, f"max |diff| {worst:.1e}{short}"))
    else:
        found.append((f"AdamW first loss equal to {FIRST_ABS:g}", diffs[0][0] <= FIRST_ABS,
                      f"|diff| {diffs[0][0]:.1e}"))
        if len(diffs) > 1:
            worst = max(r for _, r in diffs[1:])
            found.append((f"AdamW later losses within {ADAMW_REL:g} relative",
                          worst <= ADAMW_REL, f"max rel diff {worst:.1e}"))
    if len(ours.losses) != len(torch.losses):
        found.append(("same number of steps", False,
                      f"graphopt {len(ours.losses)}, PyTorch {len(torch.losses)}"))
    return found


def runs_note(side: Side) -> str:
    """Where a side's timed steps fall short of the method (bench/_common.py)."""
    if not side.ok or not side.seconds:
        return ""
    need = LONG_RUNS if side.seconds[0] > LONG_RUN_S else MIN_RUNS
    return f" (below the method's {need})" if len(side.timed) < need else ""


def _versions(graphopt_python: str) -> tuple[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    ours = subprocess.run(
        [graphopt_python, "-P", "-c",
         f"import sys; sys.path.insert(0, {str(HERE.parent)!r}); import graphopt; "
         "from _common import blas_kernel; print(graphopt.__version__); print(blas_kernel())"],
        cwd=tempfile.gettempdir(), env=bench_env(), capture_output=True, text=True)
    lines = ours.stdout.strip().splitlines() or ["?", f"unknown ({ours.stderr.strip()[-200:]})"]
    peers = []
    for name in ("torch", "transformers", "onnx"):
        try:
            peers.append(f"{name} {version(name)}")
        except PackageNotFoundError:
            peers.append(f"{name} not installed")
    return f"graphopt {lines[0]}; {', '.join(peers)}", lines[-1]


def report(args, cases: list[Case], results: dict) -> list[str]:
    lr = {o: args.lr if args.lr is not None else LR[o] for o in args.optimizer}
    optimizers = "; ".join(
        f"SGD (no momentum, weight decay 0) lr {lr[o]:g}" if o == "sgd" else
        f"AdamW (betas 0.9/0.999, eps 1e-8, weight decay 0.01 on tensors of rank >= 2) "
        f"lr {lr[o]:g}"
        for o in args.optimizer)
    extra = f" `{args.graphopt_args}`" if args.graphopt_args else ""
    lines = [
        "`graphopt run` (`--loss cross_entropy --labels labels`" + extra + ") against "
        "PyTorch eager, each in a process of its own, on random-weight `transformers` models "
        "(seed 0, eval mode: no dropout) exported by TorchScript (`ts`, opset 17) or dynamo "
        "(`dynamo`, opset 18, external data); "
        + ("every all-equal parameter (fresh norms and biases) perturbed by 0.02 * randn "
           "before the export, so that the exporter merges none. "
           if args.perturb else "exported as built (`--no-perturb`): the exporter merges "
           "parameters that start equal. ")
        + f"The same batch of random ids every step ({batch_words(args)} x {args.seq} "
        "tokens), labels shifted "
        f"left (last position -100); {optimizers}. A step is forward, loss, backward and "
        "optimizer step; the first is the warm-up, median / min over the others. Peak RSS: "
        "`/usr/bin/time -v`'s maximum resident set of each process, start to exit "
        "(MB = 10^6 bytes). Trained: tensors / weights (PyTorch: `model.parameters()`, a "
        "tied weight once; graphopt: its \"training N tensors\" line).",
        "",
        "| model | export | params | tensors (perturbed) | ONNX initializers | nodes | file MB |",
        "|---|---|---|---|---|---|---|",
    ]
    for case in cases:
        i = case.info
        if i is None:
            lines.append(f"| {case.model} | {case.export} | {case.failure} | | | | |")
            continue
        lines.append(f"| {case.model} | {case.export} | {i['params'] / 1e6:,.1f}M | "
                     f"{i['tensors']} ({len(i['perturbed'])}) | {i['initializers']} | "
                     f"{i['nodes']} | {i['file_bytes'] / MB:,.0f} |")
    lines += ["", "| model / export | optimizer | steps | peak RSS MB graphopt / PyTorch | ratio "
              "| step s graphopt (median / min) | PyTorch | ratio | trained graphopt | PyTorch "
              "| max loss diff (rel) |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for case in cases:
        for optimizer in optimizers_for(args, case):
            if case.info is None:
                lines.append(f"| {case.label} | {optimizer} | {case.failure} "
                             "| | | | | | | | |")
                continue
            ours, torch = results[case.label, optimizer]
            ratio, rss_ratio = "-", "-"
            if ours.ok and torch.ok:
                rss_ratio = _ratio(ours.rss, torch.rss)
                if ours.timed and torch.timed:
                    ratio = _ratio(statistics.median(ours.timed),
                                   statistics.median(torch.timed))
            diffs = loss_diffs(ours, torch)
            worst = (f"{max(d for d, _ in diffs):.1e} ({max(r for _, r in diffs):.1e})"
                     if diffs else "-")
            steps = max(len(ours.seconds), len(torch.seconds))
            lines.append(
                f"| {case.label} | {optimizer} | {steps}{runs_note(ours) or runs_note(torch)} | "
                f"{_fmt_rss(ours)} / {_fmt_rss(torch)} | {rss_ratio} | "
                f"{_fmt_times(ours)} | {_fmt_times(torch)} | {ratio} | {_fmt_trained(ours)} | "
                f"{_fmt_trained(torch)} | {worst} |")
    lines += ["", "Losses per step:", "", "| model / export | optimizer | step | graphopt | "
              "PyTorch | abs diff | rel diff |", "|---|---|---|---|---|---|---|"]
    for case in cases:
        for optimizer in optimizers_for(args, case):
            if case.info is None:
                continue
            ours, torch = results[case.label, optimizer]
            for step in range(max(len(ours.losses), len(torch.losses))):
                a = ours.losses[step] if step < len(ours.losses) else None
                b = torch.losses[step] if step < len(torch.losses) else None
                cells = [f"{v:.6f}" if v is not None else "-" for v in (a, b)]
                if a is not None and b is not None:
                    cells += [f"{abs(a - b):.1e}", f"{abs(a - b) / abs(b):.1e}" if b else "-"]
                else:
                    cells += ["-", "-"]
                lines.append(f"| {case.label} | {optimizer} | {step + 1} | {' | '.join(cells)} |")
    lines += ["", "Targets (graphopt against PyTorch; the step time on "
              f"{' and '.join(TIME_TARGET_MODELS)} only):", ""]
    notes = []
    for case in cases:
        for optimizer in optimizers_for(args, case):
            if case.info is None:
                lines.append(f"- {case.label} {optimizer}: **not met** ({case.failure})")
                continue
            ours, torch = results[case.label, optimizer]
            found = targets(case.model, optimizer, ours, torch)
            marks = "; ".join(f"{name} {'met' if ok else '**not met**' if ok is False else '?'}"
                              f" ({figures})" for name, ok, figures in found)
            lines.append(f"- {case.label} {optimizer}: {marks}")
            for who, side in (("graphopt", ours), ("PyTorch", torch)):
                for note in side.notes:
                    entry = f"{case.label}, {who}: {note[:300]}"
                    if entry not in notes:
                        notes.append(entry)
    torch_sides = [pair[1] for pair in results.values() if pair[1].ok]
    gaps = [abs(s.vmhwm - s.rss) / s.rss for s in torch_sides if s.vmhwm and s.rss]
    if gaps:
        notes.append(f"PyTorch's own peak (VmHWM, read at its exit) is within "
                     f"{100 * max(gaps):.1f}% of `time -v`'s in every run")
    if notes:
        lines += ["", "Notes:", "", *(f"- {n}" for n in notes)]
    versions, graphopt_blas = _versions(args.graphopt_python)
    runtimes = sorted({s.runtime for s in torch_sides if s.runtime})
    lines += ["", f"Machine: {machine()}; {versions}; PyTorch ran as "
              f"{'; '.join(runtimes) or 'unknown'}; BLAS in graphopt's environment: "
              f"{graphopt_blas}; memory limit per process {args.memory_limit:g} GB.",
              f"Command: `{command_line('bench_training_scale.py', args.argv)}`"]
    return lines


# ---- main -------------------------------------------------------------------------------------
def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=list(MODELS),
                        help=f"default {' '.join(DEFAULT_MODELS)}, each with its default export")
    parser.add_argument("--exports", nargs="+", choices=EXPORTS,
                        help="run every model with each of these (default: each model's own)")
    parser.add_argument("--optimizer", nargs="+", choices=OPTIMIZERS, default=list(OPTIMIZERS))
    parser.add_argument("--batch", type=int,
                        help=f"sequences per step (default {DEFAULT_BATCH}; falcon-1.1b 1)")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int,
                        help=f"default {STEPS} under {LARGE_PARAMS / 1e6:.0f}M parameters, "
                             f"{SMALL_STEPS} for larger models; the first is the warm-up")
    parser.add_argument("--lr", type=float,
                        help=f"default {LR['sgd']:g} for sgd, {LR['adamw']:g} for adamw")
    parser.add_argument("--graphopt-args", default="", metavar="ARGS",
                        help="more arguments for `graphopt run`, e.g. \"--untie\"")
    parser.add_argument("--no-perturb", dest="perturb", action="store_false",
                        help="export the models as built (exporters merge equal parameters)")
    parser.add_argument("--large-adamw", action="store_true",
                        help="run models over 500M parameters with AdamW too (default SGD only)")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per run")
    parser.add_argument("--memory-limit", type=float,
                        default=round(0.9 * _mem_available() / 1e9, 1), metavar="GB",
                        help="kill a run whose processes hold more (default 90%% of the "
                             "memory available at the start)")
    parser.add_argument("--cache", default=os.environ.get("GRAPHOPT_BENCH_CACHE",
                                                          "~/.cache/graphopt-bench"))
    venv = REPO / ".venv" / "bin" / "python"
    parser.add_argument("--graphopt-python", default=str(venv) if venv.exists()
                        else sys.executable, help="the interpreter that runs graphopt")
    parser.add_argument("--build-only", action="store_true", help="make the exports, no runs")
    parser.add_argument("--no-write", action="store_true", help="do not update RESULTS.md")
    parser.add_argument("--export-child", nargs=3, metavar=("MODEL", "KIND", "DEST"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--torch-child", nargs=6,
                        metavar=("MODEL", "FOLDER", "DATA", "OPTIMIZER", "LR", "STEPS"),
                        help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.argv = argv
    for name in ("batch", "seq", "steps"):
        value = getattr(args, name)
        if value is not None and value < (2 if name == "seq" else 1):
            parser.error(f"--{name} is too small: {value}")
    return args


def pairs(args) -> list[tuple[str, str]]:
    models = args.models or list(DEFAULT_MODELS)
    if args.exports:
        return [(m, e) for m in models for e in args.exports]
    return [(m, MODELS[m][1]) for m in models]


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.export_child:
        export_child(*args.export_child, perturb=args.perturb)
        return 0
    if args.torch_child:
        name, folder, data, optimizer, lr, steps = args.torch_child
        torch_child(name, folder, data, optimizer, float(lr), int(steps), args.perturb)
        return 0
    bench = Bench(args)
    print(f"cache {bench.root}; memory limit per process {args.memory_limit:g} GB; graphopt "
          f"from {args.graphopt_python}", flush=True)
    if not args.build_only:
        check_graphopt_runs(args.graphopt_python)
    cases = [bench.case(m, e) for m, e in pairs(args)]
    if args.build_only:
        return 0 if all(c.failure is None for c in cases) else 1
    results = {}
    start_loads = []  # each process starts once the last one has left the load average
    for case in cases:
        if case.info is None:
            continue
        for optimizer in optimizers_for(args, case):
            print(f"{case.label} {optimizer}: {bench.steps(case)} steps", flush=True)
            for who, run in (("graphopt", bench.run_graphopt), ("PyTorch", bench.run_torch)):
                start_loads.append(settle())
                side = run(case, optimizer)
                results.setdefault((case.label, optimizer), []).append(side)
                what = side.failure or (f"step {_fmt_times(side)} s, peak RSS "
                                        f"{_fmt_rss(side)} MB, losses "
                                        + " ".join(f"{v:.5f}" for v in side.losses[:5]))
                print(f"  {who}: {what}", flush=True)
    publish(SECTION, report(args, cases, results), write=not args.no_write,
            start_loads=start_loads)
    return 0


if __name__ == "__main__":
    sys.exit(main())

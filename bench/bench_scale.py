"""Model size: `graphopt optimize` against its peers on Hugging Face architectures of 100M to
7B parameters, built from `transformers` configs (random weights, no hub access).

Each model is exported twice into a cache folder, each export in a process of its own:
TorchScript (`ts`: dynamo=False, opset 17, dynamic batch and sequence axes, weights inline, or
one external file per tensor where the model is over 2 GB, as torch writes it) and dynamo
(`dynamo`: opset 18, external_data=True), with the input used and PyTorch's logits on it
(`reference.npz`, fixed seeds). Each tool then optimizes each export, each run a process of its
own under `/usr/bin/time -v`, its output written to a temporary folder deleted after the run:

- graphopt: `graphopt optimize IN -o OUT` (level 2), run by graphopt's own environment
  (`--graphopt-python`, default `<repo>/.venv/bin/python`) with `-P`, from a folder outside
  the repository; graphopt-refdata: the same with `--reference-data`, OUT beside IN (its
  external data is referenced where it lies, not copied), deleted after the run;
- ort: onnxruntime's offline optimizer (ORT_ENABLE_EXTENDED, CPU EP, `optimized_model_filepath`;
  external initializers for external-data models);
- onnxscript: `onnxscript.rewriter.ort_fusions.optimize_for_ort` (it runs the onnxscript
  optimizer first), saved with external data for external-data models;
- onnxslim: `onnxslim.slim`; onnxsim: `onnxsim.simplify` (`output_path`);
- baseline: `onnx.load` + `onnx.save`, inline models only.

Per model, export and tool: wall time from process start to exit (median and minimum of the
runs after a warm-up run: `--runs`, at most 3 when the warm-up took over 10 s), peak RSS
(largest of the runs), the output's main-graph node count and whether it matches PyTorch
(onnxruntime CPU with its own optimizations off, ORT_DISABLE_ALL, on the stored input:
max |logits - PyTorch's| <= 1e-4). A failure, a run over `--timeout` or over
`--memory-limit` is its cell's entry.

`falcon-7b-graph` is Falcon-7B's own configuration, whose 28 GB of float32 weights do not fit
in a 24 GB machine: its exports are the exporters' real graphs, made without materializing the
weights (see `graph_only_model`: the large weights are zero-stride views, one float of memory;
TorchScript's parameter passes run on their shapes), every large tensor in one sparse data file
(the right offsets and lengths, no byte written); it is timed only, there is no PyTorch output
to compare with. `--check-graph-only [MODEL]` (default falcon-118m; a sweep with
falcon-7b-graph runs it on its largest other Falcon) checks the method: MODEL's graph-only
exports must equal its real ones in everything but the weights' values.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/bench_scale.py \\
        [--models falcon-118m gpt2-124m falcon-1.1b falcon-7b-graph] [--exports ts dynamo] \\
        [--tools graphopt graphopt-refdata ort onnxscript onnxslim onnxsim baseline] \\
        [--runs 9] \\
        [--timeout 900] [--memory-limit GB] [--cache DIR] [--graphopt-python PY] \\
        [--build-only] [--check-graph-only [MODEL]] [--no-write]

The interpreter running it needs torch, transformers, onnx, onnxruntime, onnxscript, onnxslim,
onnxsim and threadpoolctl; torch and transformers are imported by the export processes only.
The cache (`--cache`, default `$GRAPHOPT_BENCH_CACHE` or `~/.cache/graphopt-bench`) holds the
exports (about 12 GB of disk: falcon-7b-graph's data files are sparse) and the runs' temporary
folders (a run needs 1.1x its input's bytes free: up to 33 GB, for the outputs of
falcon-7b-graph, which the tools write in full).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import MIN_RUNS, bench_env, command_line, machine, publish

SECTION = "Model size: `graphopt optimize` vs its peers on 100M-7B Hugging Face models"
# a sweep of graph-only models alone (falcon-7b-graph) has a section of its own
GRAPH_ONLY_SECTION = "Model size: Falcon-7B's exported graphs"
REPO = Path(__file__).resolve().parent.parent
HERE = Path(__file__).resolve()

SEED = 0
BATCH, SEQ = 2, 16  # the stored input
TOLERANCE = 1e-4  # max |logits - PyTorch's|
LONG_RUN_S = 10.0  # a warm-up run over this: LONG_RUNS runs suffice
LONG_RUNS = 3
POLL_S = 0.25  # how often a running tool's resident set is read (memory limit)
MB = 1e6

PEERS = ("ort", "onnxscript", "onnxslim", "onnxsim")
# graphopt-refdata: `graphopt optimize --reference-data`, the output beside the input, pointing
# at the input's external data instead of copying it (what a 7B model's user runs)
TOOLS = ("graphopt", "graphopt-refdata", *PEERS, "baseline")
EXPORTS = ("ts", "dynamo")
OPSET = {"ts": 17, "dynamo": 18}

# graph-only exports: parameters with at least this many elements are zero-stride views
GRAPH_ONLY_MIN_ELEMENTS = 1 << 16
DATA_ALIGNMENT = 4096  # offsets of the tensors in the sparse data file


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    family: str  # "falcon" or "gpt2"
    config: dict
    graph_only: bool = False
    note: str = ""


_FALCON = dict(multi_query=True, parallel_attn=True, new_decoder_architecture=False,
               alibi=False, bias=False)
MODELS = {
    "falcon-118m": ModelSpec("falcon", dict(vocab_size=32000, hidden_size=1024,
                                            num_attention_heads=16, num_hidden_layers=8,
                                            **_FALCON),
                             note="Falcon-7B's attention layout, shrunk"),
    "gpt2-124m": ModelSpec("gpt2", {}, note="GPT2Config() defaults"),
    "falcon-1.1b": ModelSpec("falcon", dict(vocab_size=65024, hidden_size=2048,
                                            num_attention_heads=32, num_hidden_layers=24,
                                            **_FALCON)),
    "falcon-7b-graph": ModelSpec("falcon", dict(vocab_size=65024, hidden_size=4544,
                                                num_attention_heads=71, num_hidden_layers=32,
                                                **_FALCON),
                                 graph_only=True,
                                 note="Falcon-7B's config; graph only, weights never "
                                      "materialized"),
}


# ---- exports (run in processes of their own: `--export MODEL KIND DEST`) --------------------
def torch_model(spec: ModelSpec):
    """The PyTorch model of ``spec`` (random weights, seed SEED), eager attention, no cache."""
    import torch
    import transformers

    config_class, model_class = {
        "falcon": (transformers.FalconConfig, transformers.FalconForCausalLM),
        "gpt2": (transformers.GPT2Config, transformers.GPT2LMHeadModel)}[spec.family]
    config = config_class(**spec.config, use_cache=False)
    config._attn_implementation = "eager"
    if spec.graph_only:
        return graph_only_model(model_class, config)
    torch.manual_seed(SEED)
    return model_class(config).eval()


def graph_only_model(model_class, config):
    """``model_class(config)`` without its weights' memory: built on the meta device, then each
    parameter of GRAPH_ONLY_MIN_ELEMENTS elements or more becomes a zero-stride view of one
    zero on the CPU (a real tensor of the right shape: TorchScript's tracer runs the forward
    on it, one layer's product at a time materialized), the smaller ones (layer norms) are
    allocated and initialized as transformers does, and modules holding buffers (the rotary
    embedding's frequencies) are rebuilt on the CPU. Tied weights stay tied."""
    import itertools

    import torch

    with torch.device("meta"):
        model = model_class(config).eval()
    zero = torch.zeros(())
    replaced: dict[int, torch.nn.Parameter] = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None:
                continue
            if id(param) not in replaced:
                big = param.numel() >= GRAPH_ONLY_MIN_ELEMENTS
                data = (zero.to(param.dtype).expand(param.shape) if big
                        else torch.empty(param.shape, dtype=param.dtype))
                replaced[id(param)] = torch.nn.Parameter(data, requires_grad=False)
            module._parameters[name] = replaced[id(param)]
    for module in model.modules():
        own = [p for p in module._parameters.values() if p is not None]
        if own and all(p.numel() < GRAPH_ONLY_MIN_ELEMENTS for p in own):
            model._init_weights(module)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if any(b.is_meta for b in child.buffers(recurse=False)):
                setattr(parent, name, type(child)(config=config))
    left = [n for n, t in itertools.chain(model.named_parameters(), model.named_buffers())
            if t.is_meta]
    if left:
        raise SystemExit(f"graph-only model: still on the meta device: {left}")
    return model


def _is_zero_view(tensor) -> bool:
    """A tensor standing for a weight of a graph-only model (zero strides, several elements)."""
    return tensor.numel() > 1 and all(s == 0 for s in tensor.stride())


def logits_only(model):
    """``model`` as ``input_ids -> logits``. The all-ones attention mask keeps transformers
    from its packed-sequence detection, which calls aten::diff (TorchScript cannot export
    it)."""
    import torch

    class LogitsOnly(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.m = inner

        def forward(self, ids):
            return self.m(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False,
                          return_dict=False)[0]

    return LogitsOnly(model).eval()


def export_child(name: str, kind: str, dest: str) -> None:
    import numpy as np
    import torch

    spec = MODELS[name]
    start = time.perf_counter()
    wrapper = logits_only(torch_model(spec))
    built = time.perf_counter() - start
    generator = torch.Generator().manual_seed(SEED + 1)
    ids = torch.randint(0, wrapper.m.config.vocab_size, (BATCH, SEQ), generator=generator)
    path = os.path.join(dest, "model.onnx")
    start = time.perf_counter()
    if spec.graph_only:
        export_graph_only(wrapper, ids, kind, path)
    else:
        export_real(wrapper, ids, kind, path)
        with torch.no_grad():
            logits = wrapper(ids).numpy()
        np.savez(os.path.join(dest, "reference.npz"), input_ids=ids.numpy(), logits=logits)
    info = {"model": name, "export": kind, "build_s": built,
            "export_s": time.perf_counter() - start,
            "params": sum(p.numel() for p in wrapper.parameters()),
            "graph_only": spec.graph_only, **model_stats(path)}
    Path(dest, "export.json").write_text(json.dumps(info, indent=1) + "\n")


def export_real(wrapper, ids, kind: str, path: str) -> None:
    import torch

    names = dict(input_names=["input_ids"], output_names=["logits"])
    if kind == "ts":
        axes = {0: "batch", 1: "seq"}
        torch.onnx.export(wrapper, (ids,), path, dynamo=False, opset_version=OPSET[kind],
                          dynamic_axes={"input_ids": axes, "logits": axes}, **names)
    else:
        dims = {0: torch.export.Dim("batch"), 1: torch.export.Dim("seq")}
        torch.onnx.export(wrapper, (ids,), path, dynamo=True, opset_version=OPSET[kind],
                          dynamic_shapes={"ids": dims}, external_data=True, **names)


def export_graph_only(wrapper, ids, kind: str, path: str) -> None:
    """The export of a graph-only model: the exporter's own graph, each zero-view weight (and
    each tensor the exporter folded from one, such as a transposed weight) an external tensor
    in one sparse file ``<path>.data``, every other tensor inline with its real value."""
    zeros = export_ts_graph_only(wrapper, ids, path) if kind == "ts" else \
        export_dynamo_graph_only(wrapper, ids, path)
    import onnx

    proto = onnx.load(path)
    data = os.path.basename(path) + ".data"
    offset = 0
    for tensor in proto.graph.initializer:
        if tensor.name not in zeros:
            continue
        shape = zeros.pop(tensor.name)
        length = math.prod(shape) * onnx.helper.tensor_dtype_to_np_dtype(tensor.data_type).itemsize
        del tensor.dims[:]
        tensor.dims.extend(shape)
        for field in ("raw_data", "float_data", "int32_data", "int64_data", "double_data"):
            tensor.ClearField(field)
        tensor.data_location = onnx.TensorProto.EXTERNAL
        del tensor.external_data[:]
        for key, value in (("location", data), ("offset", offset), ("length", length)):
            entry = tensor.external_data.add()
            entry.key, entry.value = key, str(value)
        offset = -(-(offset + length) // DATA_ALIGNMENT) * DATA_ALIGNMENT
    if zeros:
        raise SystemExit(f"graph-only export: zero tensors not among the initializers: {zeros}")
    if kind == "ts" and offset > 2**31:
        # torch's TorchScript exporter names the tensors of attributes when it writes a model
        # beyond protobuf's 2 GB (external data); it saw the stand-ins' size
        for node in proto.graph.node:
            for attribute in node.attribute:
                if attribute.type == onnx.AttributeProto.TENSOR:
                    attribute.t.name = f"{node.name}_attr::{attribute.name}"
    with open(os.path.join(os.path.dirname(path), data), "wb") as f:
        f.truncate(offset)  # a hole: reads as zeros, takes no disk
    onnx.save(proto, path)


def export_ts_graph_only(wrapper, ids, path: str) -> dict[str, list[int]]:
    """TorchScript's export of a graph-only model; returns {initializer: shape} of the tensors
    to point into the sparse file. The tracer runs the forward on the zero views (real values,
    so every constant the trace records is right); then the exporter's passes get the weights
    on the meta device (constant folding transposes them by shape), its initializer
    deduplication compares only the real ones (distinct random weights never match), and the
    serializer is handed empty stand-ins whose shapes `export_graph_only` puts back."""
    from unittest import mock

    import torch
    from torch.onnx._internal.torchscript_exporter import utils as ts_utils

    create_jit_graph = ts_utils._create_jit_graph
    deduplicate = torch._C._jit_pass_onnx_deduplicate_initializers
    zeros: dict[str, list[int]] = {}

    def create_on_meta(model, args):
        graph, params, out, module = create_jit_graph(model, args)
        params = [torch.empty(p.shape, dtype=p.dtype, device="meta") if _is_zero_view(p) else p
                  for p in params]
        return graph, params, out, module

    def deduplicate_real(graph, params, training):
        kept = deduplicate(graph, {k: v for k, v in params.items() if not v.is_meta}, training)
        for key, value in params.items():
            if value.is_meta:
                zeros[key] = list(value.shape)
                kept[key] = torch.empty(0, dtype=value.dtype)
        return kept

    axes = {0: "batch", 1: "seq"}
    with mock.patch.object(ts_utils, "_create_jit_graph", create_on_meta), \
            mock.patch.object(torch._C, "_jit_pass_onnx_deduplicate_initializers",
                              deduplicate_real):
        torch.onnx.export(wrapper, (ids,), path, dynamo=False, opset_version=OPSET["ts"],
                          input_names=["input_ids"], output_names=["logits"],
                          dynamic_axes={"input_ids": axes, "logits": axes})
    return zeros


def export_dynamo_graph_only(wrapper, ids, path: str) -> dict[str, list[int]]:
    """dynamo's export of a graph-only model (torch.export traces with fake tensors, weights
    never read); the exporter's ONNX optimizer, run as the exporter runs it, folds the
    transposes of the zero views into zero views. Returns {initializer: shape} of the zero
    ones, saved here with empty stand-ins."""
    import numpy as np
    import onnx
    import torch
    from onnxscript import ir

    dims = {0: torch.export.Dim("batch"), 1: torch.export.Dim("seq")}
    program = torch.onnx.export(wrapper, (ids,), dynamo=True, opset_version=OPSET["dynamo"],
                                input_names=["input_ids"], output_names=["logits"],
                                dynamic_shapes={"ids": dims}, optimize=False)
    program.optimize()
    zeros: dict[str, list[int]] = {}
    for name, value in program.model.graph.initializers.items():
        array = value.const_value.numpy()
        if array.size > 1 and not any(array.strides):
            zeros[name] = list(array.shape)
            value.const_value = ir.tensor(np.empty(0, array.dtype), name=name)
    onnx.save(ir.serde.serialize_model(program.model), path)
    return zeros


def model_stats(path: str) -> dict:
    """Node count, bytes (the model and its external data files), largest tensor, layout."""
    import onnx

    proto = onnx.load(path, load_external_data=False)
    folder = os.path.dirname(path)
    files, largest = {path}, 0
    for tensor in proto.graph.initializer:
        size = math.prod(tensor.dims) * onnx.helper.tensor_dtype_to_np_dtype(
            tensor.data_type).itemsize
        largest = max(largest, size)
        if tensor.data_location == onnx.TensorProto.EXTERNAL:
            where = {e.key: e.value for e in tensor.external_data}
            files.add(os.path.join(folder, where["location"]))
    stats = [os.stat(f) for f in files]
    return {"nodes": len(proto.graph.node), "file_bytes": sum(s.st_size for s in stats),
            "disk_bytes": sum(s.st_blocks * 512 for s in stats), "files": len(files),
            "largest_tensor_bytes": largest, "external": len(files) > 1}


# ---- the tools (run in processes of their own: `--tool NAME IN OUT [--external]`) -----------
def tool_child(tool: str, source: str, out: str, external: bool) -> None:
    data = os.path.basename(out) + ".data"
    if tool == "ort":
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
        options.optimized_model_filepath = out
        if external:
            options.add_session_config_entry(
                "session.optimized_model_external_initializers_file_name", data)
            options.add_session_config_entry(
                "session.optimized_model_external_initializers_min_size_in_bytes", "1024")
        ort.InferenceSession(source, options, providers=["CPUExecutionProvider"])
    elif tool == "onnxscript":
        from onnxscript import ir
        from onnxscript.rewriter.ort_fusions import optimize_for_ort

        model, _ = optimize_for_ort(ir.load(source))
        ir.save(model, out, external_data=data if external else None)
    elif tool == "onnxslim":
        import onnxslim

        onnxslim.slim(source, out, save_as_external_data=external)
    elif tool == "onnxsim":
        import onnxsim

        _, ok = onnxsim.simplify(source, output_path=out,
                                 external_data_threshold="0B" if external else "2GB")
        if not ok:
            raise SystemExit("onnxsim: the simplified model failed its check")
    elif tool == "baseline":
        import onnx

        onnx.save(onnx.load(source), out)
    else:
        raise SystemExit(f"unknown tool {tool}")


def match_child(model: str, reference: str) -> None:
    """Run ``model`` in onnxruntime (CPU, its optimizations off) on the stored input; print
    the largest difference from PyTorch's logits as JSON."""
    import numpy as np
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])
    stored = np.load(reference)
    got = session.run(None, {"input_ids": stored["input_ids"]})[0]
    if got.shape != stored["logits"].shape:
        raise SystemExit(f"logits of shape {list(got.shape)}, PyTorch's "
                         f"{list(stored['logits'].shape)}")
    print(json.dumps({"max_abs_diff": float(np.max(np.abs(got - stored["logits"])))}))


# ---- running a command: wall time, peak RSS, time and memory limits --------------------------
@dataclasses.dataclass
class Run:
    seconds: float
    rss_bytes: int | None
    failure: str | None  # None: exit status 0
    stdout: str = ""


def _session_rss(session: int) -> int:
    """Resident bytes of all processes of one session (the tool and its children)."""
    total, page = 0, os.sysconf("SC_PAGE_SIZE")
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2:].split()
        if int(fields[3]) == session:
            total += int(fields[21]) * page
    return total


def timed(command: list[str], cwd: str, timeout: float, memory_limit: float) -> Run:
    """Run ``command`` under `/usr/bin/time -v` in a session of its own; its wall seconds (from
    here), peak RSS (from time) and why it failed. Killed past ``timeout`` seconds or when
    its processes hold more than ``memory_limit`` bytes."""
    report = os.path.join(cwd, "time-v.txt")
    with open(os.path.join(cwd, "stdout.txt"), "w+") as out, \
            open(os.path.join(cwd, "stderr.txt"), "w+") as err:
        start = time.perf_counter()
        proc = subprocess.Popen(["/usr/bin/time", "-v", "-o", report, *command], cwd=cwd,
                                env=bench_env(), stdout=out, stderr=err,
                                start_new_session=True)
        killed = None
        while True:
            try:
                proc.wait(timeout=POLL_S)
                break
            except subprocess.TimeoutExpired:
                if time.perf_counter() - start > timeout:
                    killed = f"timed out (> {timeout:g} s)"
                elif _session_rss(proc.pid) > memory_limit:
                    killed = f"over the memory limit ({memory_limit / 1e9:.1f} GB)"
                if killed:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    break
        seconds = time.perf_counter() - start
        out.seek(0)
        err.seek(0)
        stdout, stderr = out.read(), err.read()
    rss = None
    with contextlib.suppress(OSError):
        for line in Path(report).read_text().splitlines():
            if "Maximum resident set size" in line:
                rss = int(line.split(":")[1]) * 1024
            if "Command terminated by signal" in line and not killed:
                killed = line.strip().lower()
    failure = killed
    if failure is None and proc.returncode != 0:
        lines = [line for line in stderr.strip().splitlines() if line.strip()]
        failure = f"failed (exit {proc.returncode}): {lines[-1][:160] if lines else ''}"
    return Run(seconds, rss, failure, stdout)


# ---- the benchmark --------------------------------------------------------------------------
@dataclasses.dataclass
class Cell:
    times: list[float] = dataclasses.field(default_factory=list)
    rss: list[int] = dataclasses.field(default_factory=list)
    warmup_s: float | None = None
    nodes: int | None = None
    diff: float | None = None
    match: str = ""  # why there is no diff
    failure: str | None = None

    @property
    def ok(self) -> bool:
        return self.failure is None and bool(self.times)

    @property
    def median(self) -> float:
        return statistics.median(self.times)


@dataclasses.dataclass
class Case:
    model: str
    export: str
    folder: Path
    info: dict

    @property
    def path(self) -> Path:
        return self.folder / "model.onnx"

    @property
    def label(self) -> str:
        return f"{self.model} {self.export}"


class Bench:
    def __init__(self, args):
        self.args = args
        self.cache = Path(args.cache).expanduser()
        self.scratch = self.cache / "runs"
        self.scratch.mkdir(parents=True, exist_ok=True)
        self.memory_limit = args.memory_limit * 1e9

    # -- exports --
    def case(self, model: str, export: str) -> Case:
        folder = self.cache / model / export
        if not (folder / "export.json").exists():
            self.build(model, export, folder)
        return Case(model, export, folder, json.loads((folder / "export.json").read_text()))

    def build(self, model: str, export: str, folder: Path) -> None:
        partial = folder.with_name(export + ".partial")
        shutil.rmtree(partial, ignore_errors=True)
        partial.mkdir(parents=True)
        print(f"exporting {model} ({export}) into {folder} ...", flush=True)
        run = timed([sys.executable, str(HERE), "--export", model, export, str(partial)],
                    str(partial), 4 * 3600, self.memory_limit)
        if run.failure:
            tail = Path(partial, "stderr.txt").read_text().strip().splitlines()[-15:]
            raise SystemExit(f"export of {model} ({export}) {run.failure}\n" + "\n".join(tail))
        for log in ("stdout.txt", "stderr.txt", "time-v.txt"):
            os.replace(partial / log, partial / f"export-{log}")
        os.replace(partial, folder)
        info = json.loads((folder / "export.json").read_text())
        print(f"  {run.seconds:.0f} s, peak RSS {(run.rss_bytes or 0) / MB:.0f} MB; "
              f"{info['nodes']} nodes, {info['file_bytes'] / MB:.0f} MB in {info['files']} "
              f"file(s), {info['disk_bytes'] / MB:.0f} MB on disk", flush=True)

    # -- one run of one tool --
    def command(self, tool: str, case: Case, out: str) -> list[str]:
        if tool in ("graphopt", "graphopt-refdata"):
            return [self.args.graphopt_python, "-P", "-m", "graphopt", "optimize",
                    str(case.path), "-o", out,
                    *(["--reference-data"] if tool == "graphopt-refdata" else [])]
        external = ["--external"] if case.info["external"] else []
        return [sys.executable, str(HERE), "--tool", tool, str(case.path), out, *external]

    def run_once(self, tool: str, case: Case, cell: Cell, warmup: bool) -> bool:
        """One run into a temporary folder, deleted afterwards: its seconds and peak RSS go
        into ``cell`` (the warm-up's seconds into ``warmup_s``, and its output's nodes are
        counted and compared with PyTorch's logits), a failure into ``cell.failure``."""
        need = case.info["file_bytes"] * 1.1 + 1e9
        free = shutil.disk_usage(self.scratch).free
        if free < need:
            cell.failure = f"skipped: {free / 1e9:.0f} GB of disk free, needs {need / 1e9:.0f}"
            return False
        folder = tempfile.mkdtemp(prefix=f"{tool}-", dir=self.scratch)
        # --reference-data writes beside the input, whose data files the output points at
        beside = tool == "graphopt-refdata" and case.info["external"]
        try:
            out = (str(case.folder / f".bench-out-{os.getpid()}.onnx") if beside
                   else os.path.join(folder, "out.onnx"))
            run = timed(self.command(tool, case, out), folder, self.args.timeout,
                        self.memory_limit)
            if run.failure is None and not os.path.exists(out):
                run.failure = "wrote no output"
            if run.failure:
                cell.failure = run.failure
                return False
            if warmup:
                cell.warmup_s = run.seconds
                self.check_output(out, case, cell, folder)
            else:
                cell.times.append(run.seconds)
                if run.rss_bytes is not None:
                    cell.rss.append(run.rss_bytes)
            return True
        finally:
            shutil.rmtree(folder, ignore_errors=True)
            if beside:
                with contextlib.suppress(OSError):
                    os.remove(out)

    def check_output(self, out: str, case: Case, cell: Cell, folder: str) -> None:
        import onnx

        cell.nodes = len(onnx.load(out, load_external_data=False).graph.node)
        if case.info["graph_only"]:
            cell.match = "n/a (graph only)"
            return
        check = timed([sys.executable, str(HERE), "--match", out,
                       str(case.folder / "reference.npz")], folder, self.args.timeout,
                      self.memory_limit)
        if check.failure:
            cell.match = f"no: onnxruntime {check.failure}"
        else:
            cell.diff = json.loads(check.stdout.strip().splitlines()[-1])["max_abs_diff"]

    # -- one model and export, every tool --
    def measure(self, case: Case, tools: list[str]) -> dict[str, Cell]:
        """A warm-up run of each tool (page cache, bytecode caches; nodes and match), then
        the timed runs, the tools taking turns so that load from elsewhere hits them alike."""
        cells = {tool: Cell() for tool in tools}
        runs = {}
        for tool in tools:
            cell = cells[tool]
            if tool == "baseline" and case.info["external"]:
                cell.failure = "n/a (external data)"
            elif self.run_once(tool, case, cell, warmup=True):
                runs[tool] = self.args.runs if cell.warmup_s <= LONG_RUN_S else \
                    min(self.args.runs, LONG_RUNS)
                print(f"  {tool}: warm-up {cell.warmup_s:.2f} s, {cell.nodes} nodes, "
                      f"{format_match(cell)}; {runs[tool]} runs", flush=True)
                continue
            print(f"  {tool}: {cell.failure}", flush=True)
        for i in range(max(runs.values(), default=0)):
            done = [tool for tool, count in runs.items() if i < count and not cells[tool].failure
                    and self.run_once(tool, case, cells[tool], warmup=False)]
            print(f"  round {i + 1}: " + ", ".join(f"{t} {cells[t].times[-1]:.2f} s"
                                                   for t in done), flush=True)
        return cells

    def graphopt_run_prep(self, case: Case) -> dict | None:
        """`graphopt run MODEL --data D --loss cross_entropy --steps 1 --batch-size 1`: its wall
        time less the step's own seconds (from `--log`) is the preparation (loading, the
        forward rewrites, differentiation, the training graph's rewrites, the executor's
        plan)."""
        folder = tempfile.mkdtemp(prefix="graphopt-run-", dir=self.scratch)
        try:
            import numpy as np

            stored = np.load(case.folder / "reference.npz")
            data = os.path.join(folder, "data.npz")
            np.savez(data, input_ids=stored["input_ids"], labels=stored["input_ids"])
            log = os.path.join(folder, "log.jsonl")
            command = [self.args.graphopt_python, "-P", "-m", "graphopt", "run",
                       str(case.path), "--data", data, "--loss", "cross_entropy",
                       "--steps", "1", "--batch-size", "1", "--log", log, "-q"]
            prep, rss, runs = [], [], 1 + self.args.runs
            while len(prep) < runs:
                run = timed(command, folder, self.args.timeout, self.memory_limit)
                if run.failure:
                    return {"failure": run.failure}
                step = json.loads(Path(log).read_text().splitlines()[-1])["seconds"]
                os.remove(log)
                prep.append(run.seconds - step)
                rss.append(run.rss_bytes or 0)
                if len(prep) == 1 and run.seconds > LONG_RUN_S:
                    runs = 1 + min(self.args.runs, LONG_RUNS)
                print(f"  graphopt run: {run.seconds:.1f} s, of which the step {step:.1f} s",
                      flush=True)
            return {"times": prep[1:], "rss": max(rss[1:])}
        finally:
            shutil.rmtree(folder, ignore_errors=True)


def correct(cell: Cell) -> bool | None:
    """Whether a cell's output matches PyTorch; None where it was not compared."""
    if cell.diff is not None:
        return cell.diff <= TOLERANCE
    return False if cell.match.startswith("no") else None


def format_match(cell: Cell) -> str:
    if cell.diff is None:
        return cell.match or "-"
    verdict = "yes" if cell.diff <= TOLERANCE else "**no**"
    return f"{verdict} ({cell.diff:.1e})"


def targets(case: Case, cells: dict[str, Cell]) -> list[tuple[str, bool | None, str]]:
    """(target, passed or None when it cannot be judged, figures) for graphopt on one case."""
    ours = cells.get("graphopt")
    if ours is None:
        return []
    if not ours.ok:
        return [("graphopt runs", False, ours.failure or "no runs")]
    peers = {t: c for t, c in cells.items() if t in PEERS and c.ok}
    found = []
    if peers:
        fastest = min(peers, key=lambda t: peers[t].median)
        found.append(("time <= fastest peer", ours.median <= peers[fastest].median,
                      f"{ours.median:.2f} s vs {fastest} {peers[fastest].median:.2f} s"))
        # a peer's node count counts where its output is right (or cannot be checked)
        right = [t for t in peers if peers[t].nodes is not None and correct(peers[t]) is not False]
        fewest = min(right, key=lambda t: peers[t].nodes, default=None)
        if fewest is not None and ours.nodes is not None:
            found.append(("nodes <= fewest of peers", ours.nodes <= peers[fewest].nodes,
                          f"{ours.nodes} vs {fewest} {peers[fewest].nodes}"))
    else:
        found.append(("time <= fastest peer", None, "no peer finished"))
    rss = max(ours.rss) if ours.rss else None
    if case.info["external"]:
        limit = 400 * MB + case.info["largest_tensor_bytes"]
        what = "RSS <= 400 MB + largest tensor"
    else:
        limit = 2 * case.info["file_bytes"]
        what = "RSS <= 2x model file"
    found.append((what, None if rss is None else rss <= limit,
                  f"{(rss or 0) / MB:.0f} MB vs {limit / MB:.0f} MB"))
    if not case.info["graph_only"]:
        found.append(("matches PyTorch", correct(ours), format_match(ours)))
    if case.model == "falcon-1.1b":
        found.append(("1.1B: <= 15 s", ours.median <= 15, f"{ours.median:.2f} s"))
    if case.model == "falcon-7b-graph":
        found.append(("7B graph: <= 60 s", ours.median <= 60, f"{ours.median:.2f} s"))
        beside = cells.get("graphopt-refdata")
        if beside is not None and beside.ok:
            found.append(("7B graph, --reference-data: <= 60 s", beside.median <= 60,
                          f"{beside.median:.2f} s"))
        found.append(("7B graph: RSS <= 2 GB", None if rss is None else rss <= 2e9,
                      f"{(rss or 0) / MB:.0f} MB"))
    return found


def check_graphopt_runs(python: str) -> None:
    """Refuse to start when graphopt's environment cannot run it (`graphopt rules` imports
    every rule)."""
    done = subprocess.run([python, "-P", "-m", "graphopt", "rules"], cwd=tempfile.gettempdir(),
                          env=bench_env(), capture_output=True, text=True)
    if done.returncode != 0:
        lines = done.stderr.strip().splitlines() or [f"exit status {done.returncode}"]
        raise SystemExit(f"graphopt does not run from {python}: {lines[-1]}")


def _versions(graphopt_python: str) -> tuple[str, str]:
    from importlib.metadata import version

    names = ("onnx", "onnxruntime", "onnxscript", "onnxslim", "onnxsim", "torch", "transformers")
    ours = subprocess.run(
        [graphopt_python, "-P", "-c",
         f"import sys; sys.path.insert(0, {str(HERE.parent)!r}); import graphopt; "
         "from _common import blas_kernel; print(graphopt.__version__); print(blas_kernel())"],
        cwd=tempfile.gettempdir(), env=bench_env(), capture_output=True, text=True)
    lines = ours.stdout.strip().splitlines() or ["?", f"unknown ({ours.stderr.strip()[-200:]})"]
    peers = ", ".join(f"{n} {version(n)}" for n in names)
    return f"graphopt {lines[0]}; {peers}", lines[-1]


def report(args, cases: list[Case], results: dict, prep: dict | None,
           method: list[str] | None) -> list[str]:
    tools = args.tools
    lines = [
        "Random-weight models built from `transformers` configs, exported by TorchScript "
        "(`ts`: opset 17, dynamic batch and sequence, weights inline or, beyond 2 GB, one file "
        "per tensor) and dynamo (`dynamo`: opset 18, external data). Each tool optimizes each "
        "export in a process of its own (graphopt `optimize`, level 2; graphopt-refdata: the "
        "same with `--reference-data`, written beside the input and pointing at its external "
        "data instead of copying it; ort: onnxruntime's "
        "offline optimizer, ORT_ENABLE_EXTENDED, CPU; onnxscript: "
        "`ort_fusions.optimize_for_ort`; onnxslim; onnxsim; baseline: onnx.load + onnx.save), "
        f"process start to exit: a warm-up run, then {args.runs} runs (at most {LONG_RUNS} for "
        f"tools whose warm-up took over {LONG_RUN_S:g} s), the tools taking turns. Peak RSS: "
        "`/usr/bin/time -v`'s maximum resident set, largest of the runs (MB = 10^6 bytes). "
        "Nodes: the output's main graph. Matches PyTorch: the output in onnxruntime (CPU, "
        f"ORT_DISABLE_ALL) on the stored {BATCH}x{SEQ} input, max |logits - PyTorch's| <= "
        f"{TOLERANCE:g}. `falcon-7b-graph`: Falcon-7B's config, its real exported graphs with "
        "the weights in one sparse file (never materialized): timed only, no PyTorch "
        "output to compare with.",
        "",
        "| model | export | params | file MB | largest tensor MB | nodes in |",
        "|---|---|---|---|---|---|",
    ]
    for case in cases:
        i = case.info
        layout = f" ({i['files']} files)" if i["files"] > 2 else ""
        lines.append(f"| {case.model} | {case.export} | {i['params'] / 1e6:,.0f}M | "
                     f"{i['file_bytes'] / MB:,.0f}{layout} | "
                     f"{i['largest_tensor_bytes'] / MB:,.0f} | {i['nodes']} |")
    lines += ["", "| model / export | tool | median s | min s | runs | peak RSS MB | nodes out "
              "| matches PyTorch (max abs diff) |", "|---|---|---|---|---|---|---|---|"]
    for case in cases:
        for tool in tools:
            cell = results[case.label][tool]
            rss = f"{max(cell.rss) / MB:,.0f}" if cell.rss else "-"
            if cell.ok:
                lines.append(f"| {case.label} | {tool} | {cell.median:.2f} | "
                             f"{min(cell.times):.2f} | {len(cell.times)} | {rss} | "
                             f"{cell.nodes} | {format_match(cell)} |")
            else:
                lines.append(f"| {case.label} | {tool} | {cell.failure or 'no runs'} | | | "
                             f"{rss} | | |")
    judged = [(case, targets(case, results[case.label])) for case in cases]
    if any(found for _, found in judged):
        peers = ", ".join(t for t in tools if t in PEERS) or "none"
        lines += ["", f"Targets (graphopt; peers: {peers}; the fewest nodes among the peers "
                  "whose output matches PyTorch):", ""]
        for case, found in judged:
            marks = "; ".join(f"{name} **{'pass' if ok else 'FAIL' if ok is False else '?'}**"
                              f" ({figures})" for name, ok, figures in found)
            lines.append(f"- {case.label}: {marks}")
    if prep is not None:
        lines.append("")
        if "failure" in prep:
            lines.append(f"`graphopt run` preparation on falcon-118m ts: {prep['failure']}")
        else:
            lines.append(
                "`graphopt run` preparation on falcon-118m ts (`graphopt run MODEL --data D "
                "--loss cross_entropy --steps 1 --batch-size 1`, wall time less the step's own "
                f"seconds from `--log`): median {statistics.median(prep['times']):.1f} s, "
                f"min {min(prep['times']):.1f} s over {len(prep['times'])} runs; peak RSS "
                f"(preparation and step) {prep['rss'] / MB:,.0f} MB.")
    if method:
        lines += ["", "The graph-only method, checked (`--check-graph-only`: "
                  "nodes with their attributes, initializer names, shapes and types, inputs and "
                  "outputs):", "", *(f"- {line}" for line in method)]
    versions, graphopt_blas = _versions(args.graphopt_python)
    lines += ["", f"Machine: {machine()}; {versions}; BLAS in graphopt's environment: "
              f"{graphopt_blas}; memory limit per tool {args.memory_limit:g} GB.",
              f"Command: `{command_line('bench_scale.py', args.argv)}`"]
    return lines


def check_graph_only(bench: Bench, model: str = "falcon-118m") -> tuple[bool, list[str]]:
    """Export ``model`` the graph-only way and compare with its real exports: everything but
    the initializers' values (and where they are stored) must be equal. (passed, lines)"""
    import onnx

    def signature(path):
        graph = onnx.load(path, load_external_data=False).graph
        nodes = [(n.op_type, n.domain, list(n.input), list(n.output), n.name,
                  [a.SerializeToString() for a in n.attribute]) for n in graph.node]
        inits = sorted((t.name, list(t.dims), t.data_type) for t in graph.initializer)
        io = [v.SerializeToString() for v in (*graph.input, *graph.output)]
        return nodes, inits, io

    passed, lines = True, []
    for export in EXPORTS:
        real = bench.case(model, export)
        with tempfile.TemporaryDirectory(dir=bench.scratch) as folder:
            run = timed([sys.executable, str(HERE), "--export", model, export, folder,
                         "--graph-only"], folder, 3600, bench.memory_limit)
            if run.failure:
                passed = False
                lines.append(f"{model} {export}: the graph-only export {run.failure}")
                continue
            ours, theirs = signature(os.path.join(folder, "model.onnx")), signature(real.path)
            info = json.loads(Path(folder, "export.json").read_text())
        differ = [part for part, a, b in zip(("nodes", "initializers", "inputs/outputs"), ours,
                                            theirs, strict=True) if a != b]
        passed &= not differ
        lines.append(f"{model} {export}: graph-only export "
                     f"{'differs in ' + ', '.join(differ) if differ else 'equal'} to the real "
                     f"one ({len(ours[0])} nodes, {len(ours[1])} initializers; its data file "
                     f"{info['file_bytes'] / MB:,.0f} MB, {info['disk_bytes'] / MB:.1f} MB on "
                     "disk)")
    return passed, lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--exports", nargs="+", choices=EXPORTS, default=list(EXPORTS))
    parser.add_argument("--tools", nargs="+", choices=TOOLS, default=list(TOOLS))
    parser.add_argument("--runs", type=int, default=MIN_RUNS,
                        help=f"timed runs after the warm-up (default {MIN_RUNS}; {LONG_RUNS} "
                             f"when the warm-up took over {LONG_RUN_S:g} s)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds per tool run")
    available = _mem_available()
    parser.add_argument("--memory-limit", type=float, default=round(0.9 * available / 1e9, 1),
                        metavar="GB", help="kill a tool whose processes hold more (default "
                                           "90%% of the memory available at the start)")
    parser.add_argument("--cache", default=os.environ.get("GRAPHOPT_BENCH_CACHE",
                                                          "~/.cache/graphopt-bench"))
    venv = REPO / ".venv" / "bin" / "python"
    parser.add_argument("--graphopt-python", default=str(venv) if venv.exists()
                        else sys.executable, help="the interpreter that runs graphopt")
    parser.add_argument("--build-only", action="store_true", help="make the exports, no runs")
    parser.add_argument("--check-graph-only", nargs="?", const="falcon-118m", metavar="MODEL",
                        choices=[m for m in MODELS if not MODELS[m].graph_only],
                        help="compare MODEL's graph-only exports with its real ones (default "
                             "falcon-118m)")
    parser.add_argument("--no-write", action="store_true", help="do not update RESULTS.md")
    parser.add_argument("--export", nargs=3, metavar=("MODEL", "KIND", "DEST"),
                        help=argparse.SUPPRESS)
    parser.add_argument("--graph-only", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--tool", nargs=3, metavar=("NAME", "IN", "OUT"), help=argparse.SUPPRESS)
    parser.add_argument("--external", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--match", nargs=2, metavar=("MODEL", "NPZ"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.argv = argv
    if args.export:
        name, kind, dest = args.export
        if args.graph_only:
            MODELS[name] = dataclasses.replace(MODELS[name], graph_only=True)
        export_child(name, kind, dest)
        return 0
    if args.tool:
        tool_child(*args.tool, external=args.external)
        return 0
    if args.match:
        match_child(*args.match)
        return 0
    if args.runs < 1:
        parser.error("--runs must be at least 1")
    bench = Bench(args)
    if args.check_graph_only:
        passed, lines = check_graph_only(bench, args.check_graph_only)
        print("\n".join(lines))
        return 0 if passed else 1
    print(f"cache {bench.cache}; memory limit per process {args.memory_limit:g} GB; graphopt "
          f"from {args.graphopt_python}", flush=True)
    if "graphopt" in args.tools and not args.build_only:
        check_graphopt_runs(args.graphopt_python)
    cases = [bench.case(m, e) for m in args.models for e in args.exports]
    if args.build_only:
        return 0
    results, prep, method = {}, None, None
    if any(MODELS[m].graph_only for m in args.models):
        # on the largest real Falcon of the sweep: falcon-1.1b's TorchScript export is, as
        # Falcon-7B's, beyond 2 GB
        real = [m for m, spec in MODELS.items() if m in args.models
                and spec.family == "falcon" and not spec.graph_only]
        method = check_graph_only(bench, real[-1] if real else "falcon-118m")[1]
        print("\n".join(method), flush=True)
    for case in cases:
        print(f"{case.label}: {case.info['nodes']} nodes, {case.info['file_bytes'] / MB:,.0f} "
              "MB", flush=True)
        results[case.label] = bench.measure(case, args.tools)
        if (case.model, case.export) == ("falcon-118m", "ts") and "graphopt" in args.tools:
            prep = bench.graphopt_run_prep(case)
    section = (GRAPH_ONLY_SECTION if all(MODELS[m].graph_only for m in args.models)
               else SECTION)
    publish(section, report(args, cases, results, prep, method), write=not args.no_write)
    return 0


def _mem_available() -> float:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 8e9


if __name__ == "__main__":
    sys.exit(main())

"""``graphopt optimize --check``: run the original and the optimized model on the same random
inputs and compare every output, as onnxsim's check does.

The runtime is onnxruntime when it is installed (an oracle nobody here wrote); otherwise
graphopt's own executor. Inputs have the declared shapes; a symbolic dimension takes the
value ``--input-shape`` gave it, else :data:`SYMBOLIC_DIM` (above 1, so that a decoder's
attention mixes positions and a batch has rows to differ in). Values: floats standard normal;
integers within the range the graph reads them with (token ids below the embedding's row
count, where a Gather reads them), else 0 or 1; a Dropout's ``training_mode`` input False
(inference, as onnxruntime runs a Dropout without one). What was used is printed.

Before anything is allocated, the random inputs' bytes (and the executor's planned peak for
each model, where it can plan it) are checked against the available memory (the executor's
figure: GRAPHOPT_MEMORY_LIMIT, else the free memory), and a shape too large for any array is
refused: each is one error line, not an allocation that the OS or onnxruntime kills.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
import onnx

from graphopt.errors import GraphoptError
from graphopt.vocabulary import attribute_or_default

RTOL, ATOL = 1e-3, 1e-4   # onnxsim's defaults for its check
SYMBOLIC_DIM = 4          # a symbolic dimension without --input-shape


@dataclass
class OutputDiff:
    name: str
    max_abs: float
    within: bool


@dataclass
class CheckResult:
    runtime: str
    runs: int
    outputs: list[OutputDiff]
    inputs: str = ""    # the shapes and value ranges drawn (describe_inputs)

    @property
    def ok(self) -> bool:
        return all(o.within for o in self.outputs)

    def format(self) -> str:
        worst = max((o.max_abs for o in self.outputs), default=0.0)
        head = (f"check: {self.runs} random input set(s) in {self.runtime}: max abs "
                f"difference {worst:.3g} (tolerance rtol {RTOL:g}, atol {ATOL:g})")
        bad = [f"{o.name} ({o.max_abs:.3g})" for o in self.outputs if not o.within]
        inputs = f"\ncheck inputs: {self.inputs}" if self.inputs else ""
        return head + (f"; outputs that differ: {', '.join(bad)}" if bad
                       else "; outputs match") + inputs


def _with_weights(model: onnx.ModelProto, base_dir: str) -> onnx.ModelProto:
    proto = onnx.ModelProto()
    proto.CopyFrom(model)
    if base_dir and any(t.data_location == onnx.TensorProto.EXTERNAL
                        for t in proto.graph.initializer):
        from onnx.external_data_helper import load_external_data_for_model

        load_external_data_for_model(proto, base_dir)
    return proto


MAX_ARRAY_BYTES = np.iinfo(np.intp).max  # what NumPy can address in one array


def input_specs(model: onnx.ModelProto, shapes: dict[str, list[int]] | None = None
                ) -> dict[str, tuple[np.dtype, list[int]]]:
    """name -> (dtype, dims) of the random array each graph input that is not an
    initializer gets; a shape no array can have is refused here, before any allocation."""
    initializers = {t.name for t in model.graph.initializer}
    specs = {}
    for value in model.graph.input:
        if value.name in initializers:
            continue
        tensor_type = value.type.tensor_type
        if not value.type.HasField("tensor_type") or not tensor_type.elem_type:
            raise GraphoptError(f"--check: input {value.name!r} is not a tensor of known type")
        try:
            dtype = np.dtype(onnx.helper.tensor_dtype_to_np_dtype(tensor_type.elem_type))
        except (KeyError, TypeError, ValueError):
            raise GraphoptError(f"--check: input {value.name!r} has an element type "
                                f"({tensor_type.elem_type}) random inputs cannot have") from None
        dims = [int(d) for d in (shapes or {}).get(value.name) or []]
        if not dims:
            dims = [d.dim_value if d.HasField("dim_value") else SYMBOLIC_DIM
                    for d in tensor_type.shape.dim]
        nbytes = dtype.itemsize * math.prod(dims)  # Python ints: no overflow
        if any(d < 0 for d in dims) or nbytes > MAX_ARRAY_BYTES:
            raise GraphoptError(
                f"--check: input {value.name!r} has shape {dims}: "
                + ("a negative dimension" if any(d < 0 for d in dims) else
                   f"{nbytes} bytes of {dtype.name}, too large for any array")
                + "; nothing was run (--input-shape NAME:DIM,DIM gives it another)")
        specs[value.name] = (dtype, dims)
    return specs


def refuse_what_cannot_fit(models, shapes: dict[str, list[int]] | None = None) -> None:
    """One error line, before anything is allocated, when the random inputs of ``models``
    (the first model's, as check() draws them) or the executor's planned peak of running any
    of them exceeds the available memory."""
    from .memory import available_bytes, estimate_peak, human, limit_source

    specs = input_specs(models[0], shapes)
    available = available_bytes(None)  # a GRAPHOPT_MEMORY_LIMIT that is no size: one line
    if available is None:
        return
    where = f"the {human(available)} available ({limit_source()})"
    lift = "nothing was run (GRAPHOPT_MEMORY_LIMIT=off lifts the limit)"
    sizes = {n: dtype.itemsize * math.prod(dims) for n, (dtype, dims) in specs.items()}
    # drawn as float64 / int64 and cast: the largest input's draw is alive with the others
    drawn = max((8 * math.prod(dims) for _, dims in specs.values()), default=0)
    total = sum(sizes.values())
    if total + drawn > available:
        name = max(sizes, key=sizes.get)
        dtype, dims = specs[name]
        raise GraphoptError(
            f"--check: the random inputs need {human(total)} ({human(total + drawn)} while "
            f"drawn; the largest, input {name!r} {dims} {dtype.name}, "
            f"{human(sizes[name])}), more than {where}; {lift}")
    dims = {n: d for n, (_, d) in specs.items()}
    for which, model in zip(("original", "optimized"), models, strict=False):
        peak = estimate_peak(model, dims)  # None: the executor cannot plan it
        if peak is not None and peak > available:
            raise GraphoptError(
                f"--check: running the {which} model on these inputs has a planned peak "
                f"memory of {human(peak)}, more than {where}; {lift}")


# ops whose output holds the values of their first input (its indices stay indices)
_SAME_VALUES = frozenset({"Cast", "Reshape", "Unsqueeze", "Squeeze", "Flatten", "Identity",
                          "Expand", "Transpose"})


def value_ranges(model: onnx.ModelProto) -> dict[str, tuple]:
    """Input -> ("index", n): an integer read as Gather indices (directly or through ops
    that keep its values: Cast, Reshape, Unsqueeze, ...) of a tensor with n rows along the
    gathered axis, the smallest such n;
    ("inference",): a Dropout's training_mode. Other inputs are not listed."""
    graph = model.graph
    inputs = {i.name for i in graph.input}
    dims = {t.name: list(t.dims) for t in graph.initializer}
    for value in list(graph.input) + list(graph.value_info):
        shape = value.type.tensor_type.shape
        if value.name not in dims and all(d.HasField("dim_value") for d in shape.dim):
            dims[value.name] = [d.dim_value for d in shape.dim]
    source = {n.output[0]: n.input[0] for n in graph.node
              if n.op_type in _SAME_VALUES and n.input and n.output}

    def origin(name: str) -> str:
        seen = set()
        while name in source and name not in seen:
            seen.add(name)
            name = source[name]
        return name

    ranges: dict[str, tuple] = {}
    for node in graph.node:
        if node.op_type == "Gather" and len(node.input) > 1:
            name = origin(node.input[1])
            axis = attribute_or_default(node, "axis")
            rows = dims.get(node.input[0])
            if name in inputs and rows and -len(rows) <= axis < len(rows):
                previous = ranges.get(name)
                if previous is None or previous[0] == "index":
                    ranges[name] = ("index", min(rows[axis], previous[1]) if previous
                                    else rows[axis])
        elif node.op_type == "Dropout" and len(node.input) > 2 and node.input[2] in inputs:
            ranges[node.input[2]] = ("inference",)
    return ranges


def _draws(model: onnx.ModelProto, shapes: dict[str, list[int]] | None = None):
    """(name, dtype, dims, how, high, words) per input: ``how`` is normal | false | bool |
    ints (in [0, high)); ``words`` say it."""
    ranges = value_ranges(model)
    for name, (dtype, dims) in input_specs(model, shapes).items():
        kind = ranges.get(name, ())
        if np.issubdtype(dtype, np.floating):
            yield name, dtype, dims, "normal", 0, "standard normal"
        elif kind == ("inference",):
            yield name, dtype, dims, "false", 0, "False (Dropout in inference mode)"
        elif dtype == np.bool_:
            yield name, dtype, dims, "bool", 2, "random True/False"
        else:
            high = max(kind[1], 1) if kind else 2
            yield name, dtype, dims, "ints", high, \
                f"in [0, {high})" + (" (Gather indices)" if kind else "")


def random_inputs(model: onnx.ModelProto, rng: np.random.Generator,
                  shapes: dict[str, list[int]] | None = None) -> dict[str, np.ndarray]:
    """One random array per graph input that is not an initializer (module docstring)."""
    feeds = {}
    for name, dtype, dims, how, high, _ in _draws(model, shapes):
        if how == "normal":
            feeds[name] = rng.standard_normal(dims).astype(dtype)
        elif how == "false":
            feeds[name] = np.zeros(dims, dtype)
        else:
            feeds[name] = rng.integers(0, high, dims).astype(dtype)
    return feeds


def describe_inputs(model: onnx.ModelProto, shapes: dict[str, list[int]] | None = None) -> str:
    """``input_ids [4, 4] int64 in [0, 50257); x [4, 16] float32 normal``: what
    :func:`random_inputs` draws."""
    parts = [f"{name} {dims} {dtype.name} {words}"
             for name, dtype, dims, _, _, words in _draws(model, shapes)]
    symbolic = " (symbolic dimensions " + str(SYMBOLIC_DIM) + " unless --input-shape gives them)"
    return "; ".join(parts) + symbolic if parts else "none"


def _runner(model: onnx.ModelProto):
    """(runtime name, feeds -> {output: array})."""
    names = [o.name for o in model.graph.output]
    try:
        import onnxruntime
    except ImportError:
        onnxruntime = None
    if onnxruntime is not None:
        options = onnxruntime.SessionOptions()
        options.graph_optimization_level = onnxruntime.GraphOptimizationLevel.ORT_DISABLE_ALL
        options.log_severity_level = 3
        try:
            session = onnxruntime.InferenceSession(model.SerializeToString(), options,
                                                   providers=["CPUExecutionProvider"])
        except Exception as exc:  # noqa: BLE001 (any load failure is one line)
            raise GraphoptError(f"--check: onnxruntime cannot load the model: "
                                f"{str(exc).strip().splitlines()[0][:200]}") from None
        return "onnxruntime", lambda feeds: dict(zip(names, session.run(names, feeds),
                                                     strict=True))
    from .errors import ExecutorError
    from .session import Session

    try:
        session = Session(model, device="cpu")
    except ExecutorError as exc:
        raise GraphoptError(f"--check: {str(exc).strip().splitlines()[0]}") from None
    return "the graphopt executor (onnxruntime is not installed)", \
        lambda feeds: session.run(feeds, names)


def check(original: onnx.ModelProto, optimized: onnx.ModelProto, runs: int, *,
          base_dir: str = "", shapes: dict[str, list[int]] | None = None,
          seed: int = 0) -> CheckResult:
    if runs < 1:
        raise GraphoptError(f"--check N needs N >= 1, not {runs}")
    refuse_what_cannot_fit((original, optimized), shapes)  # before weights, inputs, runtimes
    original = _with_weights(original, base_dir)
    optimized = _with_weights(optimized, base_dir)
    runtime, run_original = _runner(original)
    _, run_optimized = _runner(optimized)
    rng = np.random.default_rng(seed)
    worst: dict[str, OutputDiff] = {}
    for _ in range(runs):
        feeds = random_inputs(original, rng, shapes)
        try:
            expected, actual = run_original(feeds), run_optimized(feeds)
        except GraphoptError:
            raise
        except Exception as exc:  # noqa: BLE001 (a runtime failure is one line)
            raise GraphoptError(f"--check: running the models failed on inputs "
                                f"{describe_inputs(original, shapes)}: "
                                f"{str(exc).strip().splitlines()[0][:200]}; --input-shape "
                                "NAME:DIM,DIM gives other shapes") from None
        for name, want in expected.items():
            got = np.asarray(actual[name])
            want = np.asarray(want)
            if got.shape != want.shape:
                worst[name] = OutputDiff(name, float("inf"), False)
                continue
            if want.dtype.kind in "fc":
                with np.errstate(invalid="ignore"):
                    diff = np.abs(got.astype(np.float64) - want.astype(np.float64))
                diff = np.where(np.isnan(want) & np.isnan(got), 0.0, diff)
                max_abs = float(np.nanmax(diff, initial=0.0)) if diff.size else 0.0
                within = bool(np.allclose(got, want, rtol=RTOL, atol=ATOL, equal_nan=True))
            else:
                max_abs = float(np.max(np.abs(got.astype(np.float64) - want), initial=0.0))
                within = bool(np.array_equal(got, want))
            previous = worst.get(name)
            if previous is None or max_abs > previous.max_abs or not within:
                worst[name] = OutputDiff(name, max(max_abs, previous.max_abs if previous
                                                   else 0.0),
                                         within and (previous is None or previous.within))
    return CheckResult(runtime, runs, list(worst.values()), describe_inputs(original, shapes))


def base_dir_of(path: str | None) -> str:
    return os.path.dirname(os.path.abspath(path)) if path else ""

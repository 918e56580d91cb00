"""The importable entry points: ``optimize`` and ``optimize_file``."""
from __future__ import annotations

import contextlib
import difflib
import operator
import os
import time
from collections import Counter
from collections.abc import Iterable, Mapping

import onnx

from . import modelio
from .dsl import Pass, Rule
from .engine import Engine, validate
from .errors import GraphoptError
from .ir import Model
from .profile import Profile
from .registry import all_rules
from .report import Report

PROVIDERS = ("cpu", "cuda", "rocm")
INT64_MAX = 2**63 - 1   # the largest dimension an ONNX shape (int64 dim_value) can hold


def unknown_rule(name: str, known: Iterable[str]) -> GraphoptError:
    """The error for a rule name that does not exist, with the closest names when a typo
    is likely (as git and pip say "did you mean")."""
    close = difflib.get_close_matches(name, list(known), n=3, cutoff=0.6)
    hint = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
    return GraphoptError(f"unknown rule '{name}' ({hint}list them with: graphopt rules)")


def rule_names(names, what: str) -> list[str]:
    """``names`` (``only``, ``enable``, ``disable``, ``explain``) as a list of rule names: None
    is none, one string is one name; anything but strings is refused in one line."""
    if names is None:
        return []
    if isinstance(names, str):
        return [names]
    try:
        names = list(names)
    except TypeError:
        raise GraphoptError(f"{what} must be rule names (strings), not "
                            f"{type(names).__name__} {names!r}") from None
    for name in names:
        if not isinstance(name, str):
            raise GraphoptError(f"{what}: rule names are strings, not {type(name).__name__} "
                                f"{name!r} (list them with: graphopt rules)")
    return names


def select_rules(rules: Iterable | None = None, *, level: int = 2, enable: Iterable[str] = (),
                 disable: Iterable[str] = (), provider: str | None = None,
                 only: Iterable[str] = ()) -> list[Rule | Pass]:
    """Rules by level, plus ``enable``, minus ``disable``, filtered by provider. ``only``:
    just these rules, whatever their level (``disable`` and ``provider`` still apply)."""
    known = all_rules()
    only, enable = rule_names(only, "only"), rule_names(enable, "enable")
    disable = rule_names(disable, "disable")
    if level not in (1, 2):
        raise GraphoptError(f"level must be 1 or 2, not {level}")
    if provider is not None and provider not in PROVIDERS:
        raise GraphoptError(f"unknown provider '{provider}' (choose from {', '.join(PROVIDERS)})")
    for name in [*only, *enable, *disable]:
        if name not in known:
            raise unknown_rule(name, known)
    if only:
        chosen = [known[n] for n in dict.fromkeys(only)]
    elif rules is None:
        chosen = [r for r in known.values() if r.level <= level]
    else:
        chosen = []
        if isinstance(rules, (str, Rule, Pass)):
            rules = [rules]
        elif not isinstance(rules, Iterable):
            raise GraphoptError(f"rules: rule names are strings (or Rule/Pass objects), "
                                f"not {type(rules).__name__} {rules!r}")
        for rule in rules:
            if isinstance(rule, str):
                if rule not in known:
                    raise unknown_rule(rule, known)
                rule = known[rule]
            elif not isinstance(rule, (Rule, Pass)):
                raise GraphoptError(f"rules: rule names are strings (or Rule/Pass "
                                    f"objects), not {type(rule).__name__} {rule!r}")
            chosen.append(rule)
    names = {r.name for r in chosen}
    chosen += [known[n] for n in enable if n not in names]
    chosen = [r for r in chosen if r.name not in set(disable)]
    if provider is not None:
        chosen = [r for r in chosen if provider in r.providers]
    return chosen


def optimize(model, rules: Iterable | None = None, *, level: int = 2,
             enable: Iterable[str] = (), disable: Iterable[str] = (),
             provider: str | None = None, explain: Iterable[str] = (),
             check_input: bool = True, only: Iterable[str] = ()) -> tuple[onnx.ModelProto, Report]:
    """Rewrite ``model`` (a path, a ModelProto or a loaded Model) with the selected rules
    (:func:`select_rules`; ``only``: just these rules, as ``graphopt optimize --only``).

    Returns the rewritten ModelProto and a Report. The input ModelProto is not modified."""
    selection = {"rules": rules, "level": level, "enable": rule_names(enable, "enable"),
                 "disable": rule_names(disable, "disable"), "provider": provider,
                 "only": rule_names(only, "only")}
    explain = rule_names(explain, "explain")
    loaded = model if isinstance(model, Model) else modelio.load(model, check=check_input)
    return optimize_loaded(loaded, select_rules(**selection), explain=explain,
                           selection=selection)


def why_not_selected(name: str, *, rules: Iterable | None = None, level: int = 2,
                     enable: Iterable[str] = (), disable: Iterable[str] = (),
                     provider: str | None = None, only: Iterable[str] = ()) -> str:
    """Why select_rules (same arguments) left the rule ``name`` out, for --explain."""
    rule = all_rules().get(name)
    only, enable, disable = (rule_names(n, w) for n, w in
                             ((only, "only"), (enable, "enable"), (disable, "disable")))
    if rule is None:
        return "not selected"
    if name in set(disable):
        return "disabled (--disable)"
    if provider is not None and provider not in rule.providers:
        return (f"gated by provider: runs on {', '.join(sorted(rule.providers))}, "
                f"not {provider}")
    if only and name not in only and name not in set(enable):
        return "not among the rules --only names"
    if rules is not None and name not in set(enable):
        return "not among the rules asked for"
    if rule.level > level:
        return f"gated by level: a level-{rule.level} rule, the level is {level}"
    return "not selected"


def optimize_loaded(model: Model, rules: list, *, explain: Iterable[str] = (),
                    selection: dict | None = None):
    validated, report = _optimize_model(model, rules, explain=explain, selection=selection)
    return validated.flush(), report


def _optimize_model(model: Model, rules: list, *, explain: Iterable[str] = (),
                    selection: dict | None = None, profile: Profile | None = None):
    """(the validated Model, which is not ``model`` when a careful replay rolled a rewrite
    back, and the Report). ``profile``: where the rewrite and validation phases go."""
    phase = profile.phase if profile is not None else _no_phase
    explain = rule_names(explain, "explain")
    known = {r.name for r in all_rules().values()} | {r.name for r in rules}
    for name in explain:
        if name not in known:
            raise unknown_rule(name, known)
    original = model.proto.SerializeToString()
    report = Report(model=model.path or "<in-memory>", nodes_before=model.graph.node_count())
    op_types_before = op_type_counts(model)
    chosen = {r.name for r in rules}
    for name in explain:
        if name not in chosen:
            report.gated[name] = why_not_selected(name, **(selection or {}))
    start = time.perf_counter()
    with phase("rewrites"):
        Engine(rules, explain=explain).run(model, report)
    if profile is not None:
        for stats in report.rules.values():
            profile.add(f"  {stats.name}", stats.seconds)
        profile.add("  whole-model type inference (within the rewrites)",
                    model.inference_seconds)
    if model.graph.changed or any(g.changed for g in model.graphs()):
        check_start = time.perf_counter()
        try:
            with phase("validation"):
                validate(model)
        except INVALID as exc:
            reason = _why_invalid(original, model.path)
            if reason is not None:  # the input was already broken, not made so by a rule
                raise GraphoptError(f"{model.path or 'model'}: invalid ONNX model: {reason}") \
                    from None
            gated, external = report.gated, model.external
            model, report = _replay_carefully(original, model.path, rules, explain, exc)
            model.external = external  # the same input files, still open
            report.gated = {**gated, **report.gated}
        report.validation_seconds = time.perf_counter() - check_start
        report.validated = True
    report.nodes_after = model.graph.node_count()
    report.seconds = time.perf_counter() - start
    report.op_types_before = op_types_before
    report.op_types_after = op_type_counts(model)
    return model, report


@contextlib.contextmanager
def _no_phase(name: str):
    yield None


def op_type_counts(model: Model) -> dict[str, int]:
    """Nodes per op type in the model and its subgraphs, contrib ops as ``domain.Op``; read
    from the IR's op-type index (no walk over the nodes, so large graphs pay nothing)."""
    counts: Counter[str] = Counter()
    for graph in model.graphs():
        for (domain, op_type), count in graph.op_counts().items():
            counts[f"{domain}.{op_type}" if domain else op_type] += count
    return dict(sorted(counts.items()))


INVALID = (onnx.checker.ValidationError, onnx.shape_inference.InferenceError)


def _why_invalid(original: bytes, path) -> str | None:
    """Why the unmodified input fails the whole-model check, or None if it passes."""
    proto = onnx.ModelProto()
    proto.ParseFromString(original)
    try:
        validate(Model(proto, path))
    except INVALID as exc:
        return str(exc).strip().splitlines()[0]
    return None


def _replay_carefully(original: bytes, path, rules, explain, first_error):
    """Start again with a whole-model check after every rewrite: slow, but it finds the
    rewrite that broke the model, rolls it back and reports it."""
    proto = onnx.ModelProto()
    proto.ParseFromString(original)
    model = Model(proto, path)
    report = Report(model=path or "<in-memory>", nodes_before=model.graph.node_count())
    report.warnings.append("final validation failed "
                           f"({str(first_error).strip().splitlines()[0]}); "
                           "replayed with a check after every rewrite")
    Engine(rules, explain=explain, validate_each=True).run(model, report)
    try:
        validate(model)
    except INVALID as exc:  # a bug in a rule or the engine, not in the user's model
        raise GraphoptError("internal error: the optimized model still fails validation "
                            f"after a careful replay ({str(exc).strip().splitlines()[0]}); "
                            "please report it with the model") from None
    return model, report


def optimize_file(source: str, out: str | None, *, in_place: bool = False, dry_run: bool = False,
                  also_writes: dict[str, str | None] | None = None, **options) -> Report:
    """Load, optimize and atomically save; nothing is written on failure or with dry_run.

    ``also_writes``: other files the caller will write afterwards, by option name (the CLI's
    ``--report``), refused like the output when they would overwrite an input file or the
    output."""
    if out is None and not in_place and not dry_run:
        raise GraphoptError("no output: pass -o OUT, --in-place or --dry-run")
    target = source if out is None else out
    also_writes = {k: v for k, v in (also_writes or {}).items() if v}
    if not dry_run:
        modelio.check_output_path(target, source, in_place)
    for option, path in also_writes.items():
        modelio.check_output_path(path, source, what=option)
    modelio.refuse_same_outputs({**({} if dry_run else {"-o": target}), **also_writes})
    profile = options.pop("profile", None)
    reference_data = options.pop("reference_data", False)
    phase = profile.phase if profile is not None else _no_phase
    with phase("load"):
        model = modelio.load(source)
    # now that its external data files are known (and open), none of them may be an output
    for option, path in [*([] if dry_run else [("output", target)]), *also_writes.items()]:
        modelio.refuse_input_files(path, model, in_place, what=option)
    if reference_data and not dry_run:
        modelio.check_reference_data(model, target)
    input_shapes = options.pop("input_shapes", None)
    before_save = options.pop("before_save", None)
    if input_shapes:   # the graph is indexed again with the new input types
        external = model.external
        model = Model(fix_input_shapes(model.proto, input_shapes), model.path)
        model.external = external
    original = None
    if before_save is not None:
        original = onnx.ModelProto()
        original.CopyFrom(model.proto)
    explain = options.pop("explain", ())
    # save what validation accepted: a failed final check replays into a new Model
    model, report = _optimize_model(model, select_rules(**options), explain=explain,
                                    selection=options, profile=profile)
    optimized = model.flush()
    if before_save is not None:
        before_save(original, optimized)   # e.g. --check: raises to write nothing
    if not dry_run:
        try:
            with phase("save"):
                report.written = modelio.save(model, target, reference_data=reference_data)
        except OSError as exc:
            raise GraphoptError(f"{target}: cannot write: {exc.strerror or exc}") from None
    report.model = os.fspath(source)
    return report


def parse_input_shape(text: str) -> tuple[str, list[int]]:
    """``NAME:DIM,DIM,...`` (as onnxsim's --overwrite-input-shape) -> (name, dims)."""
    name, sep, dims = text.rpartition(":")
    try:
        values = [int(d) for d in dims.split(",")] if sep and name else None
    except ValueError:
        values = None
    if not values or any(v < 1 for v in values):
        raise GraphoptError(f"--input-shape {text!r}: expected NAME:DIM,DIM,... with positive "
                            "integers, e.g. input_ids:1,128")
    _check_dims_fit(name, values)
    return name, values


def _check_dims_fit(name: str, dims: list[int]) -> None:
    for index, value in enumerate(dims):
        if value > INT64_MAX:
            raise GraphoptError(f"--input-shape {name}: dimension {index} is {value}, more than "
                                f"an ONNX dimension can hold (int64, at most {INT64_MAX})")


def _checked_shape(name, dims) -> list[int]:
    """One entry of ``input_shapes`` (the Python API's, or the parsed ``--input-shape``): a
    sequence of positive integers that fit an ONNX dimension (int64)."""
    if not isinstance(name, str):
        raise GraphoptError(f"input_shapes: input names are strings, not "
                            f"{type(name).__name__} {name!r}")
    try:
        if isinstance(dims, (str, bytes)):
            raise TypeError
        values = [operator.index(d) for d in dims]
        if any(isinstance(d, bool) for d in dims):
            raise TypeError
    except TypeError:
        raise GraphoptError(f"--input-shape {name}: the dimensions must be integers, not "
                            f"{dims!r}") from None
    if not values or any(v < 1 for v in values):
        raise GraphoptError(f"--input-shape {name}: the dimensions must be positive integers, "
                            f"not {values}")
    _check_dims_fit(name, values)
    return values


def fix_input_shapes(proto: onnx.ModelProto, shapes: dict[str, list[int]]) -> onnx.ModelProto:
    """Give graph inputs fixed dimensions (symbolic ones become numbers), so shape inference
    and constant folding know them. A fixed dimension may not change; the rank must match."""
    graph = proto.graph
    initializers = {t.name for t in graph.initializer}
    inputs = {i.name: i for i in graph.input if i.name not in initializers}
    if not isinstance(shapes, Mapping):
        raise GraphoptError(f"input_shapes must map input names to dimensions, not "
                            f"{type(shapes).__name__}")
    shapes = {name: _checked_shape(name, dims) for name, dims in shapes.items()}
    for name, dims in shapes.items():
        if name not in inputs:
            close = difflib.get_close_matches(name, list(inputs), n=1)
            hint = f"did you mean '{close[0]}'? " if close else ""
            raise GraphoptError(f"--input-shape: the model has no input '{name}' ({hint}its "
                                f"inputs are {', '.join(inputs) or 'none'})")
        tensor_type = inputs[name].type.tensor_type
        declared = list(tensor_type.shape.dim)
        if tensor_type.HasField("shape") and len(declared) != len(dims):
            raise GraphoptError(f"--input-shape {name}: {len(dims)} dimensions given, the input "
                                f"has {len(declared)}")
        for index, (dim, value) in enumerate(zip(declared, dims, strict=False)):
            if dim.HasField("dim_value") and dim.dim_value not in (0, value):
                raise GraphoptError(f"--input-shape {name}: dimension {index} is fixed at "
                                    f"{dim.dim_value} in the model, not {value}")
        del tensor_type.shape.dim[:]
        for value in dims:
            tensor_type.shape.dim.add().dim_value = value
    # intermediate shapes recorded with the old symbols would contradict the new ones
    del graph.value_info[:]
    return proto

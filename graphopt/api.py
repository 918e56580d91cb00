"""The importable entry points: ``optimize`` and ``optimize_file``."""
from __future__ import annotations

import os
import time
from collections.abc import Iterable

import onnx

from . import modelio
from .dsl import Pass, Rule
from .engine import Engine, validate
from .errors import GraphoptError
from .ir import Model
from .registry import all_rules
from .report import Report

PROVIDERS = ("cpu", "cuda", "rocm")


def select_rules(rules: Iterable | None = None, *, level: int = 2, enable: Iterable[str] = (),
                 disable: Iterable[str] = (), provider: str | None = None) -> list[Rule | Pass]:
    """Rules by level, plus ``enable``, minus ``disable``, filtered by provider."""
    known = all_rules()
    if level not in (1, 2):
        raise GraphoptError(f"level must be 1 or 2, not {level}")
    if provider is not None and provider not in PROVIDERS:
        raise GraphoptError(f"unknown provider '{provider}' (choose from {', '.join(PROVIDERS)})")
    for name in [*enable, *disable]:
        if name not in known:
            raise GraphoptError(f"unknown rule '{name}' (list them with: graphopt rules)")
    if rules is None:
        chosen = [r for r in known.values() if r.level <= level]
    else:
        chosen = []
        for rule in rules:
            if isinstance(rule, str):
                if rule not in known:
                    raise GraphoptError(
                        f"unknown rule '{rule}' (list them with: graphopt rules)")
                rule = known[rule]
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
             check_input: bool = True) -> tuple[onnx.ModelProto, Report]:
    """Rewrite ``model`` (a path, a ModelProto or a loaded Model) with the selected rules.

    Returns the rewritten ModelProto and a Report. The input ModelProto is not modified."""
    loaded = model if isinstance(model, Model) else modelio.load(model, check=check_input)
    return optimize_loaded(loaded, select_rules(rules, level=level, enable=enable,
                                                disable=disable, provider=provider),
                           explain=explain)


def optimize_loaded(model: Model, rules: list, *, explain: Iterable[str] = ()):
    explain = list(explain)
    known = {r.name for r in all_rules().values()} | {r.name for r in rules}
    for name in explain:
        if name not in known:
            raise GraphoptError(f"unknown rule '{name}' (list them with: graphopt rules)")
    original = model.proto.SerializeToString()
    report = Report(model=model.path or "<in-memory>", nodes_before=len(model.graph.nodes))
    start = time.perf_counter()
    Engine(rules, explain=explain).run(model, report)
    if model.graph.changed or any(g.changed for g in model.graphs()):
        check_start = time.perf_counter()
        try:
            validate(model)
        except INVALID as exc:
            reason = _why_invalid(original, model.path)
            if reason is not None:  # the input was already broken, not made so by a rule
                raise GraphoptError(f"{model.path or 'model'}: invalid ONNX model: {reason}") \
                    from None
            model, report = _replay_carefully(original, model.path, rules, explain, exc)
        report.validation_seconds = time.perf_counter() - check_start
        report.validated = True
    report.nodes_after = len(model.graph.nodes)
    report.seconds = time.perf_counter() - start
    return model.flush(), report


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
    report = Report(model=path or "<in-memory>", nodes_before=len(model.graph.nodes))
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
    model = modelio.load(source)
    # now that its external data files are known (and open), none of them may be an output
    for option, path in [*([] if dry_run else [("output", target)]), *also_writes.items()]:
        modelio.refuse_input_files(path, model, in_place, what=option)
    explain = options.pop("explain", ())
    _, report = optimize_loaded(model, select_rules(**options), explain=explain)
    if not dry_run:
        try:
            modelio.save(model, target)
        except OSError as exc:
            raise GraphoptError(f"{target}: cannot write: {exc.strerror or exc}") from None
    report.model = os.fspath(source)
    return report

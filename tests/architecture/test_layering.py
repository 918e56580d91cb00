"""Who may import whom: the layer map of CONTRIBUTING.md's code map, read from the
source (every import statement, lazy ones inside functions included), so an import that
breaks a layer fails here and names the file.

Low to high: the shared vocabulary; graphopt's core (IR, pattern language, matcher, engine,
model I/O, API); the rules, written in the DSL; graph building for training; the executor,
which runs ONNX graphs and knows none of graphopt's optimizer; the trainer, the application
above both halves; the command line on top."""
from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]

# installed package -> folder (setup.cfg's package_dir; cli.py is placed by setup.py)
FOLDERS = {"graphopt": "graphopt", "graphopt.rules": "rules", "graphopt.executor": "executor",
           "graphopt.trainer": "trainer"}

# graphopt.inference: bounded ONNX shape inference, the one way every layer runs it;
# graphopt.tensor_types: the type-and-shape service on it (engine, training builder, executor)
BASE = ("graphopt.vocabulary", "graphopt.errors", "graphopt.layout", "graphopt.inference",
        "graphopt.tensor_types")
CORE = {"core", "dsl", "ir"}  # graphopt's own modules: the DSL, the IR and the rest
# layer -> the layers it may import (third-party and stdlib are free)
MAY_IMPORT = {
    "base": {"base"},
    **{name: {"base", *CORE} for name in CORE},
    "rules": {"base", "dsl", "ir", "rules"},
    "training": {"base", *CORE, "training"},
    "executor": {"base", "executor"},
    "trainer": {"base", *CORE, "training", "executor", "trainer"},
    "cli": {"base", *CORE, "rules", "training", "executor", "trainer", "cli"},
}
# The two launchers (the console script and ``python -m graphopt``) start the command line:
# they are the only modules below it that import it.
LAUNCHERS = {"graphopt.console", "graphopt.__main__"}
# The registry reads the built-in rules' explicit list (graphopt.rules.RULES), and only that:
# the one core module that imports the rules layer, lazily (the rules import the DSL)
RULE_LIST = ("graphopt.registry", "graphopt.rules")


def layer(module: str) -> str:
    def within(prefix):
        return module == prefix or module.startswith(prefix + ".")
    if any(within(b) for b in BASE):
        return "base"
    for prefix, name in (("graphopt.cli", "cli"), ("graphopt.trainer", "trainer"),
                         ("graphopt.executor", "executor"), ("graphopt.training", "training"),
                         ("graphopt.rules", "rules"), ("graphopt.dsl", "dsl"),
                         ("graphopt.ir", "ir")):
        if within(prefix):
            return name
    return "core"  # graphopt itself (its __init__) included


def modules():
    """(installed module name, path) of every module of the package."""
    yield "graphopt.cli", ROOT / "cli.py"
    for package, folder in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            yield ".".join([package, *parts]), path


def imports(module: str, path: pathlib.Path):
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = module.split(".") if is_package else module.split(".")[:-1]
                base = ".".join(parts[:len(parts) - node.level + 1])
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module
            yield target
            # ``from graphopt import executor`` imports a module, not a name
            yield from (f"{target}.{alias.name}" for alias in node.names
                        if target == "graphopt")


def violations(extra: dict[str, str] | None = None) -> list[str]:
    """Every import across layers the map does not allow; ``extra`` adds one import
    (module -> target) to check the check."""
    found = []
    for module, path in modules():
        own = layer(module)
        targets = list(imports(module, path))
        if extra and module in extra:
            targets.append(extra[module])
        for target in targets:
            if target != "graphopt" and not target.startswith("graphopt."):
                continue
            theirs = layer(target)
            if theirs in MAY_IMPORT[own] or (module in LAUNCHERS and theirs == "cli") \
                    or (module, target) == RULE_LIST:
                continue
            found.append(f"{path.relative_to(ROOT)} ({own}) imports {target} ({theirs})")
    return sorted(set(found))


def test_every_import_respects_the_layer_map():
    assert violations() == []


def test_the_map_covers_the_whole_package():
    names = [module for module, _ in modules()]
    assert len(names) == len(set(names))
    for expected in ("graphopt.ir", "graphopt.rules.gather_slice_to_split",
                     "graphopt.executor.session", "graphopt.trainer.loop",
                     "graphopt.training.builder", "graphopt.cli"):
        assert expected in names


@pytest.mark.parametrize("module, target", [
    ("graphopt.executor.session", "graphopt.engine"),
    ("graphopt.executor.session", "graphopt"),
    ("graphopt.executor.plan", "graphopt.training.builder"),
    ("graphopt.engine", "graphopt.executor.session"),
    ("graphopt.training.builder", "graphopt.trainer.loop"),
    ("graphopt.rules.fold_constants", "graphopt.engine"),
    ("graphopt.trainer.loop", "graphopt.cli"),
    ("graphopt.ir", "graphopt.rules.fold_constants"),
    ("graphopt.registry", "graphopt.rules.fold_constants"),   # the list, not a rule module
])
def test_a_forbidden_import_is_caught(module, target):
    assert any(f"imports {target} (" in line for line in violations({module: target}))

"""Who may import whom, for the training halves (issue 13, items 1-2): graphopt builds graphs
(graphopt.training included) and knows nothing of running them; executor/ runs ONNX graphs and
knows nothing of graphopt's optimizer or training builder; trainer/ is the application above
both. Read from the source (import statements, lazy ones included), so a new import that
breaks a layer fails here."""
from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.join(os.path.dirname(__file__), os.pardir)

# graphopt's optimizer and graph builders, as the executor would name them
BUILDERS = ("graphopt.api", "graphopt.engine", "graphopt.match", "graphopt.dsl",
            "graphopt.registry", "graphopt.report", "graphopt.rules", "graphopt.training",
            "graphopt.trainer")
RUNNERS = ("graphopt.executor", "graphopt.trainer", "executor", "trainer")


def imports(folder: str, package: str) -> list[tuple[str, str]]:
    """(file, absolute module name) of every import in ``folder``; relative imports resolved
    against ``package``, the folder's installed name."""
    found = []
    base = os.path.join(ROOT, folder)
    for directory, _, files in os.walk(base):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(directory, name)
            relative = os.path.relpath(path, base)[:-3].replace(os.sep, ".")
            module = f"{package}.{relative}".removesuffix(".__init__")
            parts = module.split(".") if name == "__init__.py" else module.split(".")[:-1]
            with open(path, encoding="utf-8") as handle:
                tree = ast.parse(handle.read(), path)
            for node in ast.walk(tree):
                if isinstance(node, ast.Import):
                    found += [(path, alias.name) for alias in node.names]
                elif isinstance(node, ast.ImportFrom):
                    if node.level:
                        prefix = ".".join(parts[:len(parts) - node.level + 1])
                        target = f"{prefix}.{node.module}" if node.module else prefix
                    else:
                        target = node.module
                    found.append((path, target))
                    found += [(path, f"{target}.{alias.name}") for alias in node.names]
    return found


def offending(found, banned) -> list[str]:
    return sorted({f"{os.path.relpath(path, ROOT)} imports {name}" for path, name in found
                   if any(name == b or name.startswith(b + ".") for b in banned)})


def test_the_executor_knows_onnx_not_graphopts_optimizer_or_training_builder():
    found = imports("executor", "graphopt.executor")
    bare = [name for _, name in found if name == "graphopt"]
    assert not bare, "executor/ imports the graphopt package itself (its optimizer comes along)"
    assert offending(found, BUILDERS) == []


@pytest.mark.parametrize("folder, package", [("graphopt", "graphopt"),
                                             ("graphopt/training", "graphopt.training")])
def test_graphopt_builds_graphs_and_runs_none(folder, package):
    assert offending(imports(folder, package), RUNNERS) == []

"""tools/mutation.py's tables hold: every area's modules and tests exist, each maps to its
place in the installed package, and every recorded equivalent mutant names a function its
module still has, with the reason it cannot change behaviour. (The mutation runs themselves
are not part of CI.)"""
from __future__ import annotations

import importlib.util
import re
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def load_tool():
    spec = importlib.util.spec_from_file_location("mutation_tool", ROOT / "tools" / "mutation.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module   # (its dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module


TOOL = load_tool()


@pytest.mark.parametrize("name", list(TOOL.AREAS))
def test_every_area_names_modules_and_tests_that_exist(name):
    area = TOOL.AREAS[name]
    for path in area.sources + area.tests:
        assert (ROOT / path).exists(), path
    for path in area.sources:
        assert TOOL.package_path(path).startswith("graphopt")


def test_the_package_layout_is_the_installed_one():
    assert TOOL.package_path("rules/fold_shapes.py") == "graphopt/rules/fold_shapes.py"
    assert TOOL.package_path("trainer") == "graphopt/trainer"
    assert TOOL.package_path("cli.py") == "graphopt/cli.py"
    assert TOOL.package_path("graphopt/modelio.py") == "graphopt/modelio.py"
    with pytest.raises(SystemExit, match="not part of the graphopt package"):
        TOOL.package_path("tests/conftest.py")


def _source_of(module: str) -> Path:
    """graphopt.rules.fold_shapes -> rules/fold_shapes.py (the repository's layout)."""
    parts = module.split(".")[1:]
    head = {"rules": "rules", "executor": "executor", "trainer": "trainer", "cli": "cli.py"}
    if parts and parts[0] in head:
        first = head[parts[0]]
        rest = parts[1:]
        return ROOT / (first if not rest else f"{first}/{'/'.join(rest)}.py")
    return ROOT / "graphopt" / ("/".join(parts) + ".py")


def test_every_equivalent_mutant_is_explained_and_names_an_existing_function():
    entries = tomllib.loads((ROOT / "tools" / "mutation_equivalents.toml").read_text())
    names = [e["mutant"] for e in entries["equivalent"]]
    assert len(names) == len(set(names))
    for entry in entries["equivalent"]:
        assert entry["line"].strip() and len(entry["reason"]) > 20, entry
        # a function: module.x_name__mutmut_N; a method: module.xǁClassǁname__mutmut_N
        found = re.fullmatch(r"(.+?)\.(?:x_|xǁ(\w+)ǁ)(\w+?)__mutmut_\d+", entry["mutant"])
        assert found, entry["mutant"]
        module, owner, function = found.groups()
        source = _source_of(module)
        assert source.is_file(), entry["mutant"]
        text = source.read_text()
        if owner:
            assert re.search(rf"^class {owner}\b", text, re.M), entry
        indent = r"\s+" if owner else ""
        assert re.search(rf"^{indent}def {re.escape(function)}\(", text, re.M), entry

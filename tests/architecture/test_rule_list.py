"""The registry's built-in rules are exactly rules/__init__.py's explicit RULES list, and that
list holds the rule of every rule file (a file left out of it fails here, not silently)."""
from __future__ import annotations

import importlib
import pathlib

from graphopt.dsl import Pass, Rule
from graphopt.registry import builtin_rules
from graphopt.rules import RULES

RULES_DIR = pathlib.Path(__file__).resolve().parents[2] / "rules"


def test_every_rule_file_is_listed():
    defined = []
    for path in sorted(RULES_DIR.glob("*.py")):
        if path.name.startswith("_"):
            continue
        module = importlib.import_module(f"graphopt.rules.{path.stem}")
        found = [v for v in vars(module).values() if isinstance(v, (Rule, Pass))]
        assert found, f"rules/{path.name} defines no Rule or Pass"
        defined.extend(found)
    assert [id(r) for r in RULES] == [id(r) for r in defined]


def test_the_registry_reads_the_list():
    assert builtin_rules() == list(RULES)

"""Rules read graphs through graphopt's DSL and IR API (views of nodes and tensors, the
graph's questions), never through a NodeProto or ModelProto: no ``.proto`` in rules/."""
from __future__ import annotations

import ast
import pathlib

RULES_DIR = pathlib.Path(__file__).resolve().parents[2] / "rules"


def test_no_rule_reads_a_proto():
    found = []
    for path in sorted(RULES_DIR.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Attribute) and node.attr == "proto":
                found.append(f"{path.name}:{node.lineno}")
    assert found == []

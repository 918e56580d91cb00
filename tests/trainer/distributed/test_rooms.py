"""trainer/distributed/ is one module per job, layered: each imports only the rooms listed
before it in the package docstring (job control knows nothing of buckets or the trainer)."""
from __future__ import annotations

import ast
import pathlib

from graphopt.trainer import distributed

PACKAGE = pathlib.Path(distributed.__file__).parent
ROOMS = ["job", "sharding", "transport", "buckets", "trainer"]


def _sibling_imports(path: pathlib.Path) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            found.add((node.module or "").split(".")[0])
    return found


def test_the_docstring_lists_every_room_in_order():
    modules = sorted(p.stem for p in PACKAGE.glob("*.py") if p.stem != "__init__")
    assert sorted(ROOMS) == modules
    listed = [line.split()[0] for line in distributed.__doc__.split("Rooms,")[1].splitlines()
              if line.startswith("  ") and not line.startswith("   ")]
    assert listed == ROOMS


def test_each_room_imports_only_rooms_before_it():
    for index, room in enumerate(ROOMS):
        later = _sibling_imports(PACKAGE / f"{room}.py") - set(ROOMS[:index])
        assert not later, f"{room} imports {sorted(later)}, which come after it"

"""The one name each of graphopt's top-level folders is imported under.

setup.cfg maps ``rules/``, ``executor/`` and ``trainer/`` to ``graphopt.rules``,
``graphopt.executor`` and ``graphopt.trainer``. With the repository root on ``sys.path``
the same folders are also importable as ``rules``, ``executor`` and ``trainer``: a second
copy of every module, with its own kernel and rule registries that the first never sees.
Each of those packages calls :func:`refuse_second_name` first, so that copy cannot exist.
"""
from __future__ import annotations


def refuse_second_name(module_name: str, folder: str) -> None:
    if module_name != f"graphopt.{folder}":
        raise ImportError(
            f"the {folder}/ folder is the package graphopt.{folder}; import it under that "
            f"name, not as '{module_name}' (a second name would load a second copy, with "
            "registries of its own): install the project (pip install -e .) and run "
            "pytest, not python -m pytest, from the repository root")

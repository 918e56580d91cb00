"""graphopt: declarative ONNX graph rewriting and a reference training executor.

The public names load on first use, so that ``import graphopt`` is cheap: the console script
(graphopt/console.py) can then guard the heavy imports against Ctrl-C.
"""
from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# Python started in a source checkout imports this folder, not the installed package, and
# the installed package's graphopt.executor, .trainer and .rules live beside it (setup.cfg's
# package_dir maps them): search the checkout's root for subpackages too, so that
# `from graphopt.executor import Session` works there as it does installed
_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if os.path.isfile(os.path.join(_ROOT, "setup.cfg")) and all(
        os.path.isdir(os.path.join(_ROOT, sub)) for sub in ("executor", "trainer", "rules")):
    __path__.append(_ROOT)   # noqa: F821  (a package's own search path)

if TYPE_CHECKING:  # what type checkers and editors see; at run time __getattr__ loads them
    from .api import optimize, optimize_file, select_rules  # noqa: F401
    from .dsl import (  # noqa: F401
        Pass,
        Rule,
        attr,
        check,
        const,
        constant,
        fan_out,
        inner_nodes_read_only_by_match,
        is_float,
        one_of,
        op,
        produced_by,
        scalar_const,
        single_consumer,
        var,
    )
    from .errors import GraphoptError  # noqa: F401
    from .modelio import load, save  # noqa: F401
    from .registry import all_rules, register  # noqa: F401

_EXPORTS = {
    "optimize": "api", "optimize_file": "api", "select_rules": "api",
    "Pass": "dsl", "Rule": "dsl", "attr": "dsl", "check": "dsl", "const": "dsl",
    "constant": "dsl", "fan_out": "dsl", "inner_nodes_read_only_by_match": "dsl",
    "is_float": "dsl", "one_of": "dsl", "op": "dsl",
    "produced_by": "dsl", "scalar_const": "dsl", "single_consumer": "dsl", "var": "dsl",
    "GraphoptError": "errors",
    "load": "modelio", "save": "modelio",
    "all_rules": "registry", "register": "registry",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'graphopt' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))

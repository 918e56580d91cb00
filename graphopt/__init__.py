"""graphopt: declarative ONNX graph rewriting and a reference training executor."""
__version__ = "0.1.0"

from .api import optimize, optimize_file, select_rules  # noqa: E402
from .dsl import (Pass, Rule, attr, check, const, constant, fan_out, is_float, one_of, op,  # noqa: E402,E501
                  scalar_const, single_consumer, var)
from .errors import GraphoptError  # noqa: E402
from .modelio import load, save  # noqa: E402
from .registry import all_rules, register  # noqa: E402

__all__ = ["optimize", "optimize_file", "select_rules", "Rule", "Pass", "op", "var", "const",
           "scalar_const", "attr", "check", "constant", "fan_out", "is_float", "GraphoptError",
           "load", "save", "register", "all_rules"]

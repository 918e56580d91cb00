"""Where rules come from: the built-in ``graphopt.rules`` package, rules registered in code,
and third-party packages through the ``graphopt.rules`` entry point group."""
from __future__ import annotations

from importlib.metadata import entry_points

from .dsl import Pass, Rule
from .errors import GraphoptError

ENTRY_POINT_GROUP = "graphopt.rules"
_registered: dict[str, Rule | Pass] = {}


def register(*rules: Rule | Pass) -> None:
    """Make user rules available by name to ``optimize`` and the CLI."""
    for rule in rules:
        if not isinstance(rule, (Rule, Pass)):
            raise TypeError(f"not a Rule or Pass: {rule!r}")
        _check_name(rule, "graphopt.register")
        _registered[rule.name] = rule


def _check_name(rule: Rule | Pass, source: str) -> None:
    """Rules are selected, sorted and reported by name: a name must be a non-empty string."""
    if not isinstance(rule.name, str) or not rule.name:
        raise GraphoptError(f"{source}: a rule's name must be a non-empty string, not "
                            f"{type(rule.name).__name__} {rule.name!r}")


def builtin_rules() -> list[Rule | Pass]:
    """The built-in rules, as ``graphopt.rules.RULES`` lists them."""
    from graphopt.rules import RULES  # here: the rules import graphopt's DSL, not this

    return list(RULES)


def plugin_rules() -> list[Rule | Pass]:
    rules = []
    for ep in sorted(entry_points(group=ENTRY_POINT_GROUP), key=lambda e: e.name):
        try:
            obj = ep.load()
        except Exception as exc:  # a broken plugin must not break graphopt
            raise GraphoptError(f"rule plugin '{ep.name}' failed to load: {exc}") from None
        items = obj if isinstance(obj, (list, tuple)) else [obj]
        for rule in items:
            if isinstance(rule, (Rule, Pass)):
                _check_name(rule, f"rule plugin '{ep.name}'")
                rules.append(rule)
    return rules


def all_rules() -> dict[str, Rule | Pass]:
    """Every known rule by name, in a stable order: built-ins, plugins, registered."""
    rules: dict[str, Rule | Pass] = {}
    for rule in builtin_rules() + plugin_rules() + list(_registered.values()):
        rules[rule.name] = rule
    return dict(sorted(rules.items(), key=lambda kv: (kv[1].level, kv[0])))

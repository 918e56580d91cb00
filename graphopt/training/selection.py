"""Which initializers are trained: names or fnmatch patterns, checked against the model.

Default: every floating-point initializer. ``trainable`` narrows that set, ``freeze`` takes
names out of it and ``train`` puts names back (``train`` wins over ``freeze``, so
``freeze=["*"], train=["head.*"]`` fine-tunes the head only). Integer initializers (shapes,
indices, axes) are never trainable. A pattern that matches nothing is an error: it is
almost always a typo, and a silent no-op would train the wrong parameters.
"""
from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Sequence

from ..errors import GraphoptError
from .types import FLOAT_TYPES

Patterns = str | Iterable[str] | None


def as_patterns(patterns: Patterns) -> list[str]:
    if patterns is None:
        return []
    if isinstance(patterns, str):
        return [patterns]
    return list(patterns)


def matching(names: Sequence[str], patterns: Sequence[str], option: str) -> set[str]:
    """Names matched by any pattern; every pattern must match at least one name."""
    found: set[str] = set()
    unmatched = []
    for pattern in patterns:
        hits = fnmatch.filter(names, pattern) if _is_pattern(pattern) else \
            [pattern] if pattern in names else []
        if not hits:
            unmatched.append(pattern)
        found.update(hits)
    if unmatched:
        raise GraphoptError(f"{option}: {', '.join(map(repr, unmatched))} match(es) no "
                            f"candidate; candidates are {_preview(names)}")
    return found


def _is_pattern(text: str) -> bool:
    return any(c in text for c in "*?[")


def _preview(names: Sequence[str], limit: int = 12) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return f"[{shown}{', ...' if len(names) > limit else ''}] ({len(names)})"


def select_trainable(initializers: Sequence[tuple[str, int]], trainable: Patterns = None,
                     freeze: Patterns = (), train: Patterns = ()) -> list[str]:
    """The trainable initializer names, in model order. ``initializers``: (name, elem_type)."""
    all_names = [name for name, _ in initializers]
    float_names = [name for name, elem_type in initializers if elem_type in FLOAT_TYPES]

    def float_only(patterns: list[str], option: str) -> set[str]:
        selected = matching(all_names, patterns, option)
        named_integers = [n for n in patterns if n in selected and n not in float_names]
        if named_integers:  # asked for by exact name: say why it cannot be
            raise GraphoptError(f"{option}: {', '.join(map(repr, named_integers))} is not "
                                "floating-point; integer initializers are never trainable")
        return selected.intersection(float_names)

    if trainable is None:
        chosen = set(float_names)
    else:
        chosen = float_only(as_patterns(trainable), "trainable")
    chosen -= matching(all_names, as_patterns(freeze), "freeze")
    chosen |= float_only(as_patterns(train), "train")
    return [name for name in float_names if name in chosen]

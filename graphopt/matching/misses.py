"""Why a pattern did not match: reasons whose text is built only when someone shows it
(--explain); the engine's fast path never builds one."""
from __future__ import annotations

import onnx


class Miss:
    """Why a pattern did not match; the text is only built when someone asks."""

    __slots__ = ("fmt", "args")

    def __init__(self, fmt: str, *args):
        self.fmt, self.args = fmt, args

    def __str__(self) -> str:
        return self.fmt.format(*self.args)


class JoinedMiss(Miss):
    """The misses of several alternatives, joined only when shown."""

    __slots__ = ("misses",)

    def __init__(self, misses: list[Miss]):
        self.misses = misses

    def __str__(self) -> str:
        return "; ".join(str(m) for m in self.misses)


class NodeLabel:
    """A node's name for a Miss, formatted only if the Miss is ever shown (it holds the
    node itself: a later rewrite that removes it does not change what the Miss says)."""

    __slots__ = ("node",)

    def __init__(self, node: onnx.NodeProto):
        self.node = node

    def __str__(self) -> str:
        node = self.node
        return f"{node.op_type} '{node.name}'" if node.name else f"{node.op_type} (unnamed)"

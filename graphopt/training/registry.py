"""The gradient registry: one small definition per forward op type.

A definition receives a :class:`GradientContext` (the forward node, the gradients of its
outputs, and an emitter to build nodes with) and returns one entry per forward input: the
name of that input's gradient, or None. It may skip inputs whose gradient nobody needs
(``ctx.needs(i)``); anything it emits that ends up unused is pruned anyway::

    @gradient("Relu")
    def relu(ctx):
        return [ctx.ms("ReluGrad", ctx.dy, ctx.input(0))]
"""
from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import onnx
from onnx import helper

from ..errors import GraphoptError
from ..ir import STANDARD_DOMAIN, normalize_domain
from ..vocabulary import attribute_default
from .emitter import Emitter

GradientFn = Callable[["GradientContext"], Sequence[str | None]]

GRADIENTS: dict[tuple[str, str], GradientFn] = {}


def gradient(*op_types: str, domain: str = STANDARD_DOMAIN) -> Callable[[GradientFn], GradientFn]:
    """Register the decorated function as the gradient of ``op_types`` in ``domain``."""

    def register(fn: GradientFn) -> GradientFn:
        for op_type in op_types:
            GRADIENTS[(normalize_domain(domain), op_type)] = fn
        return fn

    return register


def gradient_of(node: onnx.NodeProto) -> GradientFn | None:
    return GRADIENTS.get((normalize_domain(node.domain), node.op_type))


def op_label(node: onnx.NodeProto) -> str:
    """``op_type`` for standard ops, ``domain.op_type`` otherwise."""
    domain = normalize_domain(node.domain)
    return f"{domain}.{node.op_type}" if domain else node.op_type


class GradientContext:
    """One forward node seen from its gradient definition.

    Building methods (``op``, ``ms``, ``sum_to``, ...) come from the :class:`Emitter`; the
    rest describes the node: ``input(i)``/``output(i)`` (names, "" when absent), ``dy``/
    ``output_grad(i)`` (None where an output gets no gradient), ``attr``, ``needs(i)``,
    and the shape table ``shape``/``rank``/``dtype``/``constant``.
    """

    def __init__(self, node: onnx.NodeProto, output_grads: Sequence[str | None],
                 needs: Sequence[bool], emitter: Emitter, names_fresh: Callable[[str], str],
                 padding_rows: Mapping[str, int] | None = None):
        self.node = node
        # embedding weight -> the row its lookups send no gradient to (nn.Embedding's
        # padding_idx); read by the Gather definition
        self.padding_rows = dict(padding_rows or {})
        self.output_grads = list(output_grads)
        self._needs = list(needs)
        self.emitter = emitter
        self._fresh = names_fresh

    # ---- the forward node --------------------------------------------------------------
    @property
    def name(self) -> str:
        return self.node.name or self.node.op_type

    @property
    def opset(self) -> int:
        return self.emitter.opset

    def input(self, i: int) -> str:
        return self.node.input[i] if i < len(self.node.input) else ""

    def output(self, i: int) -> str:
        return self.node.output[i] if i < len(self.node.output) else ""

    @property
    def num_inputs(self) -> int:
        return len(self.node.input)

    @property
    def dy(self) -> str | None:
        return self.output_grads[0]

    def output_grad(self, i: int) -> str | None:
        return self.output_grads[i] if i < len(self.output_grads) else None

    def needs(self, i: int) -> bool:
        return i < len(self._needs) and self._needs[i]

    def attr(self, name: str, default=None):
        for attribute in self.node.attribute:
            if attribute.name == name:
                return helper.get_attribute_value(attribute)
        return default

    def attr_or_default(self, name: str):
        """The attribute's value, or the default the op's schema gives at the model's opset
        (KeyError for an attribute without one)."""
        value = self.attr(name)
        if value is None:
            value = attribute_default(self.node.op_type, name, self.node.domain, self.opset)
        return value

    def forward_output(self, i: int, hint: str) -> str:
        """Output ``i`` of the forward node, adding it when the export left it out (the
        LayerNormalization statistics, MaxPool indices, the loss's log-probabilities)."""
        while len(self.node.output) <= i:
            self.node.output.append("")
        if not self.node.output[i]:
            self.node.output[i] = self._fresh(f"{self.name}_{hint}")
        return self.node.output[i]

    def fail(self, why: str) -> GraphoptError:
        return GraphoptError(
            f"cannot differentiate {op_label(self.node)} node {self.name!r}: {why}")

    # ---- shapes of forward tensors -------------------------------------------------------
    def shape(self, tensor: str):
        return self.emitter.types.shape(tensor)

    def rank(self, tensor: str) -> int:
        rank = self.emitter.types.rank(tensor)
        if rank is None:
            raise self.fail(f"the rank of {tensor!r} is unknown (shape inference could not "
                            "type it)")
        return rank

    def dtype(self, tensor: str) -> int | None:
        return self.emitter.types.dtype(tensor)

    def is_float(self, tensor: str) -> bool:
        return self.emitter.types.is_float(tensor)

    def constant(self, tensor: str, what: str):
        """The value of a constant input such as axes; an error names the node otherwise."""
        value = self.emitter.types.constant(tensor)
        if value is None:
            raise self.fail(f"its {what} ({tensor!r}) must be a constant")
        return value

    # ---- building (delegated to the emitter) ----------------------------------------------
    def __getattr__(self, name: str):
        # op, ms, const, ints, scalar, shape_of, reshape_like, zeros_like, reduce_sum,
        # unsqueeze, squeeze, sum_to: the emitter's vocabulary, reachable as ctx.<name>
        if name.startswith("_"):
            raise AttributeError(name)
        return getattr(self.emitter, name)

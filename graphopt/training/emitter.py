"""Appends the nodes of the backward pass: fresh names, deduplicated constants, and the
opset-aware building blocks every gradient definition shares (reduce a broadcast gradient
back to its input's shape, reshape like a forward tensor, zeros like a forward tensor).

Shapes come from :class:`TypeTable`; where a dim is unknown the blocks read the shape at
run time (``Shape``, ``BroadcastGradientArgs``) instead, so a model with dynamic axes gets a
graph that is right for every input size.
"""
from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..ir import MS_DOMAIN, NameGenerator
from .types import Dim, TypeTable


class Emitter:
    """Builds the backward nodes of one training graph; gradient definitions reach it
    through their context (``ctx.op``, ``ctx.sum_to``, ...)."""

    def __init__(self, names: NameGenerator, opset: int, types: TypeTable):
        self.names = names
        self.opset = opset
        self.types = types
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []
        self.scope = "Grad"
        self._constants: dict[tuple, str] = {}
        self._shapes: dict[str, str] = {}
        self._produced: set[str] = set()
        self._renames: dict[str, str] = {}

    # ---- raw nodes and constants ------------------------------------------------------
    def op(self, op_type: str, *inputs: str | None, domain: str = "", outputs: int = 1,
           **attrs) -> str | list[str]:
        """Append one node; returns its output name (a list when ``outputs`` > 1).
        ``None`` inputs are omitted optional inputs; ``None`` attributes are left out."""
        node_name = self.names.fresh(f"{self.scope}/{op_type}")
        out_names = [self.names.fresh(f"{node_name}_output_{i}") for i in range(outputs)]
        node = helper.make_node(op_type, [i or "" for i in inputs], out_names, name=node_name,
                                domain=domain or None,
                                **{k: v for k, v in attrs.items() if v is not None})
        self.nodes.append(node)
        self._produced.update(out_names)
        return out_names[0] if outputs == 1 else out_names

    def ms(self, op_type: str, *inputs: str | None, outputs: int = 1, **attrs):
        """A com.microsoft node (the contrib ops ONNX Runtime's gradient builder uses)."""
        return self.op(op_type, *inputs, domain=MS_DOMAIN, outputs=outputs, **attrs)

    def const(self, value: np.ndarray, hint: str = "const") -> str:
        """An initializer holding ``value``; equal constants share one initializer."""
        value = np.asarray(value)
        key = (value.dtype.str, value.shape, value.tobytes())
        name = self._constants.get(key)
        if name is None:
            name = self.names.fresh(f"Grad/{hint}")  # shared across nodes: no node scope
            self.initializers.append(numpy_helper.from_array(value, name))
            self._constants[key] = name
        return name

    def ints(self, values: Sequence[int]) -> str:
        return self.const(np.array(list(values), dtype=np.int64), "ints")

    def scalar(self, value: float, like: str) -> str:
        """A 0-d constant of ``like``'s element type (CastLike where the type is unknown)."""
        elem_type = self.types.dtype(like)
        if elem_type is not None:
            dtype = helper.tensor_dtype_to_np_dtype(elem_type)
            return self.const(np.array(value, dtype=dtype), "scalar")
        value_f32 = self.const(np.array(value, dtype=np.float32), "scalar")
        if self.opset >= 15:
            return self.op("CastLike", value_f32, like)
        return value_f32

    # ---- shapes -------------------------------------------------------------------------
    def shape_of(self, tensor: str) -> str:
        """An int64 shape tensor of ``tensor``: a constant when static, else ``Shape``."""
        cached = self._shapes.get(tensor)
        if cached is None:
            static = self.types.static_shape(tensor)
            cached = self.ints(static) if static is not None else self.op("Shape", tensor)
            self._shapes[tensor] = cached
        return cached

    def reshape_like(self, x: str, like: str) -> str:
        return self.op("Reshape", x, self.shape_of(like))

    def zeros(self, shape: str, like: str) -> str:
        """Zeros of the runtime shape ``shape`` and of ``like``'s element type."""
        elem_type = self.types.dtype(like) or onnx.TensorProto.FLOAT
        zero = helper.make_tensor("zero", elem_type, [1], [0])
        return self.op("ConstantOfShape", shape, value=zero)

    def zeros_like(self, tensor: str) -> str:
        return self.zeros(self.shape_of(tensor), like=tensor)

    # ---- opset-dependent signatures -----------------------------------------------------
    def reduce_sum(self, x: str, axes: Sequence[int], keepdims: bool) -> str:
        if self.opset >= 13:  # axes became an input in opset 13
            return self.op("ReduceSum", x, self.ints(axes), keepdims=int(keepdims))
        return self.op("ReduceSum", x, axes=list(axes), keepdims=int(keepdims))

    def unsqueeze(self, x: str, axes: Sequence[int]) -> str:
        if self.opset >= 13:
            return self.op("Unsqueeze", x, self.ints(axes))
        return self.op("Unsqueeze", x, axes=list(axes))

    def squeeze(self, x: str, axes: Sequence[int]) -> str:
        if self.opset >= 13:
            return self.op("Squeeze", x, self.ints(axes))
        return self.op("Squeeze", x, axes=list(axes))

    # ---- broadcasting ---------------------------------------------------------------------
    def sum_to(self, grad: str, target: str, grad_shape: Sequence[Dim] | None) -> str:
        """Reduce ``grad`` (shaped ``grad_shape``, the broadcast result) to ``target``'s shape:
        sum over the leading dims ``target`` lacks and over its size-1 dims that were
        stretched, as NumPy broadcasting requires of a gradient."""
        target_shape = self.types.shape(target)
        axes = _broadcast_axes(target_shape, grad_shape)
        if axes is None:
            return self._sum_to_at_runtime(grad, target)
        if not axes:
            return grad
        leading = len(grad_shape) - len(target_shape)
        if axes == list(range(leading)):
            return self.reduce_sum(grad, axes, keepdims=False)
        reduced = self.reduce_sum(grad, axes, keepdims=True)
        return self.reshape_like(reduced, target) if leading else reduced

    def _sum_to_at_runtime(self, grad: str, target: str) -> str:
        """Unknown dims: ONNX Runtime's formulation, broadcast axes computed from the shapes."""
        target_axes, _ = self.ms("BroadcastGradientArgs", self.shape_of(target),
                                 self.op("Shape", grad), outputs=2)
        if self.opset >= 13:
            reduced = self.op("ReduceSum", grad, target_axes, keepdims=1, noop_with_empty_axes=1)
        else:
            reduced = self.ms("ReduceSumTraining", grad, target_axes, keepdims=1,
                              noop_with_empty_axes=1)
        return self.reshape_like(reduced, target)


    # ---- finishing ----------------------------------------------------------------------
    def name_output(self, tensor: str, wanted: str) -> None:
        """Make ``tensor`` available as ``wanted`` (a graph output name): rename it when this
        emitter made it and nothing else took that route yet, else copy it with Identity
        (a forward tensor, a YieldOp output, or a gradient shared by two parameters)."""
        if tensor in self._produced and tensor not in self._renames:
            self._renames[tensor] = wanted
        else:
            self.nodes.append(helper.make_node("Identity", [tensor], [wanted],
                                               name=self.names.fresh(f"{wanted}/Identity")))

    def live_nodes(self, outputs: Sequence[str]) -> list[onnx.NodeProto]:
        """The emitted nodes ``outputs`` depend on, renames applied, in emission order
        (which is topological: a node is emitted after the nodes it reads)."""
        for node in self.nodes:
            for i, name in enumerate(node.input):
                node.input[i] = self._renames.get(name, name)
            for i, name in enumerate(node.output):
                node.output[i] = self._renames.get(name, name)
        producer = {out: i for i, node in enumerate(self.nodes) for out in node.output}
        keep: set[int] = set()
        stack = list(outputs)
        while stack:
            index = producer.get(stack.pop())
            if index is not None and index not in keep:
                keep.add(index)
                stack.extend(self.nodes[index].input)
        return [node for i, node in enumerate(self.nodes) if i in keep]

    def live_initializers(self, nodes: Sequence[onnx.NodeProto]) -> list[onnx.TensorProto]:
        read = {name for node in nodes for name in node.input}
        return [t for t in self.initializers if t.name in read]


def external_inputs(nodes: Sequence[onnx.NodeProto], own: Sequence[onnx.TensorProto]) -> set[str]:
    """Tensors ``nodes`` read that neither they nor their initializers ``own`` define."""
    defined = {out for node in nodes for out in node.output} | {t.name for t in own}
    return {name for node in nodes for name in node.input if name and name not in defined}


def _broadcast_axes(target: Sequence[Dim] | None, result: Sequence[Dim] | None) -> list[int] | None:
    """Axes of ``result`` to sum so it matches ``target``; None when only run time can tell
    (a dim of ``target`` that is unknown could be a broadcast 1)."""
    if target is None or result is None or len(result) < len(target):
        return None
    leading = len(result) - len(target)
    axes = list(range(leading))
    for i, dim in enumerate(target):
        out = result[leading + i]
        if dim == 1:
            if out != 1:  # stretched, or unknown: summing a size-1 axis is harmless
                axes.append(leading + i)
        elif isinstance(dim, int) or (isinstance(dim, str) and dim == out):
            continue  # a known non-1 dim (or the same symbol) was not broadcast
        else:
            return None
    return axes


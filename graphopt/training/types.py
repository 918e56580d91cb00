"""Shapes and element types of the forward graph, from one run of ONNX shape inference.

Gradient definitions ask for them to choose static formulations (a constant reshape target,
a known set of broadcast axes) and fall back to runtime ``Shape`` nodes where a dim is
unknown. A dim is an int, a symbol (str) or None.
"""
from __future__ import annotations

import itertools

import numpy as np
import onnx
from onnx import numpy_helper

from ..tensor_types import infer_types
from ..vocabulary import FLOAT_TYPES, STANDARD_DOMAIN, normalize_domain, type_dims

Dim = int | str | None


class TypeTable:
    """Element type and shape of every tensor shape inference could type, and the values of
    constants (initializers, Constant nodes) for attributes passed as inputs (axes, splits)."""

    def __init__(self) -> None:
        self._dtypes: dict[str, int] = {}
        self._shapes: dict[str, list[Dim] | None] = {}
        self._constants: dict[str, onnx.TensorProto | onnx.AttributeProto] = {}

    @classmethod
    def infer(cls, model: onnx.ModelProto) -> TypeTable:
        table = cls()
        graph = model.graph
        try:
            # data_prop turns shapes computed by Shape/Concat/Gather chains into static ones
            found = infer_types(model)
        except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError):
            found = {}  # fall back on what the model declares; dynamic paths cover the rest
        declared = {vi.name: vi.type for vi in itertools.chain(graph.input, graph.output,
                                                               graph.value_info)}
        # types from the inference; values (initializers, Constants) from the model itself:
        # inference ran on a view without the weights' bytes
        for name, type_proto in itertools.chain(declared.items(), found.items()):
            if type_proto.HasField("tensor_type"):
                table.set(name, type_proto.tensor_type.elem_type or None, type_dims(type_proto))
        for init in graph.initializer:
            table.set(init.name, init.data_type, list(init.dims))
            table._constants[init.name] = init
        for node in graph.node:
            if (node.op_type == "Constant" and normalize_domain(node.domain) == STANDARD_DOMAIN
                    and node.attribute):
                attr = node.attribute[0]
                table._constants[node.output[0]] = attr
                if attr.name == "value":
                    table.set(node.output[0], attr.t.data_type, list(attr.t.dims))
        return table

    def set(self, name: str, elem_type: int | None, dims: list[Dim] | None) -> None:
        if elem_type:
            self._dtypes[name] = elem_type
        if dims is not None or name not in self._shapes:
            self._shapes[name] = dims

    def dtype(self, name: str) -> int | None:
        return self._dtypes.get(name)

    def shape(self, name: str) -> list[Dim] | None:
        return self._shapes.get(name)

    def rank(self, name: str) -> int | None:
        shape = self.shape(name)
        return None if shape is None else len(shape)

    def static_shape(self, name: str) -> list[int] | None:
        """The shape when every dim is a known int, else None."""
        shape = self.shape(name)
        if shape is None or not all(isinstance(d, int) for d in shape):
            return None
        return list(shape)

    def constant(self, name: str) -> np.ndarray | None:
        """The value of an initializer or Constant node, None for computed tensors."""
        source = self._constants.get(name)
        if source is None:
            return None
        if isinstance(source, onnx.TensorProto):
            return numpy_helper.to_array(source)
        if source.name == "value":
            return numpy_helper.to_array(source.t)
        if source.name in ("value_int", "value_ints", "value_float", "value_floats"):
            value = onnx.helper.get_attribute_value(source)
            return np.array(value, dtype=np.int64 if "int" in source.name else np.float32)
        return None

    def is_float(self, name: str) -> bool:
        """Unknown types count as float: better to ask for a gradient than to drop one."""
        dtype = self.dtype(name)
        return dtype is None or dtype in FLOAT_TYPES

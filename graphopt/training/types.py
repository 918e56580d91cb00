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

from ..ir import constant_node_value
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
        # the inputs' and outputs' declarations where inference finds nothing; value_info
        # is a claim inference checks, not a fact (graphopt.tensor_types.infer_types)
        declared = {vi.name: vi.type for vi in itertools.chain(graph.input, graph.output)}
        # types from the inference; values (initializers, Constants) from the model itself:
        # inference ran on a view without the weights' bytes
        for name, type_proto in itertools.chain(declared.items(), found.items()):
            if type_proto.HasField("tensor_type"):
                table.set(name, type_proto.tensor_type.elem_type or None, type_dims(type_proto))
        fed = {i.name for i in graph.input}   # an initializer a run may be fed is no constant
        for init in graph.initializer:
            table.set(init.name, init.data_type, list(init.dims))
            if init.name not in fed:
                table._constants[init.name] = init
        for node in graph.node:
            if node.op_type == "Constant" and normalize_domain(node.domain) == STANDARD_DOMAIN:
                table._constants[node.output[0]] = node
                value = constant_node_value(node)
                if value is not None:
                    table.set(node.output[0], onnx.helper.np_dtype_to_tensor_dtype(value.dtype),
                              list(value.shape))
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
        """The value of an initializer (one a run cannot be fed) or Constant node, None for
        computed tensors; a Constant is read as graphopt.ir reads it."""
        source = self._constants.get(name)
        if source is None:
            return None
        if isinstance(source, onnx.TensorProto):
            return numpy_helper.to_array(source)
        return constant_node_value(source)

    def is_float(self, name: str) -> bool:
        """Unknown types count as float: better to ask for a gradient than to drop one."""
        dtype = self.dtype(name)
        return dtype is None or dtype in FLOAT_TYPES

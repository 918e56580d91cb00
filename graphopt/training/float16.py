"""float16 copies of a model, for mixed-precision and float16 training.

The model's float tensors become float16 (initializers, Constant values, Cast targets and
other dtype attributes, float graph inputs); its float outputs are cast back to float32 so a
loss (softmax, log, mean over many tokens) computed on them is in float32, as autocast does.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..errors import GraphoptError
from ..vocabulary import STANDARD_DOMAIN, normalize_domain

FLOAT, HALF = TensorProto.FLOAT, TensorProto.FLOAT16
_DTYPE_ATTRIBUTES = {"Cast": "to", "RandomNormal": "dtype", "RandomUniform": "dtype",
                     "RandomNormalLike": "dtype", "RandomUniformLike": "dtype",
                     "EyeLike": "dtype", "Multinomial": "dtype"}


def to_float16(model: onnx.ModelProto, keep_outputs_fp32: bool = True) -> onnx.ModelProto:
    """A float16 copy of ``model``: float32 initializers, Constant values, graph inputs and
    dtype attributes become float16. ``keep_outputs_fp32``: each float output is produced by
    a final Cast to float32 (the original name is kept, the float16 tensor is renamed)."""
    proto = onnx.ModelProto()
    proto.CopyFrom(model)
    graph = proto.graph
    for index, tensor in enumerate(graph.initializer):
        if tensor.data_type == FLOAT:
            graph.initializer[index].CopyFrom(_half_tensor(tensor))
    for node in graph.node:
        if normalize_domain(node.domain) != STANDARD_DOMAIN:
            continue
        for attr in node.attribute:
            if attr.type == onnx.AttributeProto.TENSOR and attr.t.data_type == FLOAT:
                attr.t.CopyFrom(_half_tensor(attr.t))
            elif attr.name == _DTYPE_ATTRIBUTES.get(node.op_type) and attr.i == FLOAT:
                attr.i = HALF
        if any(a.type == onnx.AttributeProto.GRAPH for a in node.attribute):
            raise GraphoptError(f"--precision fp16/mixed does not convert subgraphs "
                                f"(node {node.name!r}, {node.op_type})")
    for value in graph.input:
        _retype(value)
    del graph.value_info[:]  # re-inferred by whoever needs them
    if keep_outputs_fp32:
        _cast_outputs_back(graph)
    else:
        for value in graph.output:
            _retype(value)
    return proto


def _half_tensor(tensor: onnx.TensorProto) -> onnx.TensorProto:
    array = numpy_helper.to_array(tensor).astype(np.float16)
    return numpy_helper.from_array(array, tensor.name)


def _retype(value: onnx.ValueInfoProto) -> None:
    if value.type.tensor_type.elem_type == FLOAT:
        value.type.tensor_type.elem_type = HALF


def _cast_outputs_back(graph: onnx.GraphProto) -> None:
    taken = {n for node in graph.node for n in list(node.input) + list(node.output)}
    taken |= {t.name for t in graph.initializer} | {i.name for i in graph.input}
    for value in graph.output:
        # float16 outputs too: a model stored in float16 gets its loss in float32 as well
        if value.type.tensor_type.elem_type not in (FLOAT, HALF):
            continue
        value.type.tensor_type.elem_type = FLOAT
        half = f"{value.name}/float16"
        while half in taken:
            half += "_"
        taken.add(half)
        for node in graph.node:  # rename the producer and every reader
            node.output[:] = [half if o == value.name else o for o in node.output]
            node.input[:] = [half if i == value.name else i for i in node.input]
        graph.node.append(helper.make_node("Cast", [half], [value.name], to=FLOAT,
                                           name=f"{value.name}/cast_to_float32"))

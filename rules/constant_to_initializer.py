"""``Constant`` nodes -> initializers holding the same tensor under the same name.

A Constant computes nothing: ONNX Runtime turns every one into an initializer when it loads a
graph, before any optimizer runs, and onnxscript's optimizer does the same. TorchScript
exports write one per Slice bound, Unsqueeze axis and shape entry (a quarter of Falcon's and
GPT-2's nodes); as initializers they are what every rule's constant checks already read, and
eliminate_common_subexpressions can merge the nodes that read equal ones.

Left alone: a Constant whose output is a graph output (the output would have no producing
node), one holding a sparse tensor (that is a sparse initializer, another list), one whose
tensor lives in an external file (its bytes are the loader's to move), and every Constant of
a model whose IR version is below 4 (there an initializer must also be a graph input).
Annotations such as ``__backwardpass`` say nothing about the value and are dropped with the
node.
"""
from __future__ import annotations

import onnx

from graphopt.dsl import Pass

_A = onnx.AttributeProto
_T = onnx.TensorProto
# the Constant's other value attributes -> the element type of the tensor they hold
_SCALARS = {"value_float": _T.FLOAT, "value_int": _T.INT64, "value_string": _T.STRING}
_LISTS = {"value_floats": _T.FLOAT, "value_ints": _T.INT64, "value_strings": _T.STRING}


def _tensor(graph, node_id: int, name: str) -> onnx.TensorProto | None:
    node = graph.node(node_id)
    values = [a for a in node.attribute if not a.name.startswith("__")]
    if len(values) != 1:
        return None
    attr = values[0]
    if attr.name == "value" and attr.type == _A.TENSOR:
        if attr.t.data_location == onnx.TensorProto.EXTERNAL:
            return None
        tensor = onnx.TensorProto()
        tensor.CopyFrom(attr.t)
        tensor.name = name
        return tensor
    value = onnx.helper.get_attribute_value(attr)
    if attr.name in _SCALARS:
        return onnx.helper.make_tensor(name, _SCALARS[attr.name], [], [value])
    if attr.name in _LISTS:
        return onnx.helper.make_tensor(name, _LISTS[attr.name], [len(value)], list(value))
    return None  # sparse_value, or an attribute no Constant has


def convert(graph, report) -> int:
    if graph.model.ir_version < 4:
        return 0
    converted = 0
    for node_id in sorted(graph.nodes_of_type("Constant"), key=graph.order_of):
        outputs = graph.outputs_of(node_id)
        if len(outputs) != 1 or not outputs[0] or graph.is_output(outputs[0]):
            continue
        if not graph.is_used(outputs[0]):  # read by nothing: it goes without a trace
            graph.remove_node(node_id)
            converted += 1
            continue
        tensor = _tensor(graph, node_id, outputs[0])
        if tensor is None:
            continue
        graph.remove_node(node_id)
        graph.add_initializer(tensor)
        converted += 1
    return converted


PASS = Pass(
    name="constant_to_initializer",
    description="Constant nodes -> initializers (as ONNX Runtime does on loading)",
    level=1,
    tags=("cleanup",),
    run=convert,
)

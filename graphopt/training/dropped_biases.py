"""Zero biases the dynamo exporter dropped, put back as the parameters they are.

A fresh model's Linear and LayerNorm biases are zeros, and the dynamo exporter's optimizer
removes an addition of zeros: the Gemm loses its C input, the LayerNormalization its B, a
MatMul its Add. PyTorch still trains those biases. Each such node still says in its
``pkg.torch.onnx.fx_node`` metadata that the call read the module's bias placeholder
(``%p_<module path with underscores>_bias``), and its name scopes give the module's path:
:func:`restore_dropped_biases` gives the node a zero initializer named as the parameter
(``<module path>.bias``) again, so a run trains it and the model it writes holds it.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..ir import NameGenerator, graph_names
from ..vocabulary import attribute_or_default
from .shared import fx_node_text, module_scope

# the op types a biased call becomes, and the input the bias is (a MatMul gets an Add after
# it instead)
_BIAS_INPUT = {"Gemm": 2, "LayerNormalization": 2, "Conv": 2, "ConvTranspose": 2}


def _bias_width(node: onnx.NodeProto, shapes: dict[str, list[int]]) -> int | None:
    """The bias length of a Gemm (its output columns), LayerNormalization (its scale's
    size), Conv/ConvTranspose (its output channels) or MatMul (the weight's last dimension),
    from the weight's initializer."""
    weight = shapes.get(node.input[1]) if len(node.input) > 1 else None
    if not weight:
        return None
    if node.op_type == "Gemm":
        return weight[0] if attribute_or_default(node, "transB") else weight[-1]
    if node.op_type == "LayerNormalization":
        return int(np.prod(weight))
    if node.op_type == "Conv":
        return weight[0]
    if node.op_type == "ConvTranspose":
        return weight[1] * attribute_or_default(node, "group")
    return weight[-1]


def restore_dropped_biases(model: onnx.ModelProto) -> list[str]:
    """Put back, in place, each module bias the exporter dropped (see the module's words);
    returns their names."""
    graph = model.graph
    shapes = {t.name: list(t.dims) for t in graph.initializer}
    types = {t.name: t.data_type for t in graph.initializer}
    fresh = NameGenerator(graph_names(graph)).fresh
    restored: list[str] = []
    added_nodes: list[tuple[int, onnx.NodeProto]] = []
    for index, node in enumerate(graph.node):
        if node.op_type not in (*_BIAS_INPUT, "MatMul"):
            continue
        module = module_scope(node)
        text = fx_node_text(node)
        if not module or f"%p_{module.replace('.', '_')}_bias" not in text:
            continue
        name = f"{module}.bias"
        position = _BIAS_INPUT.get(node.op_type)
        present = position is not None and len(node.input) > position and node.input[position]
        if present or name in shapes or node.input[1] not in types:
            continue
        width = _bias_width(node, shapes)
        if width is None:
            continue
        dtype = helper.tensor_dtype_to_np_dtype(types[node.input[1]])
        graph.initializer.append(numpy_helper.from_array(np.zeros(width, dtype), name))
        shapes[name], types[name] = [width], types[node.input[1]]
        if position is not None:
            while len(node.input) < position:
                node.input.append("")
            node.input.append(name)
        else:   # MatMul -> MatMul + Add, the Add keeping the MatMul's output name
            product = fresh(f"{node.output[0]}/without_bias")
            added = helper.make_node("Add", [product, name], [node.output[0]],
                                     name=fresh(f"{node.name or 'MatMul'}/bias"))
            for prop in node.metadata_props:
                added.metadata_props.add(key=prop.key, value=prop.value)
            node.output[0] = product
            added_nodes.append((index, added))
        restored.append(name)
    for index, added in reversed(added_nodes):
        graph.node.insert(index + 1, added)
    return restored

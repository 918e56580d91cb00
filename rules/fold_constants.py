"""Nodes whose inputs are all small constants -> initializers holding their result (so the
rules after it see constants where exporters wrote Unsqueeze(Constant) and the like). A Shape
or Size of a tensor whose shape is fully known is a constant too: fixing symbolic input
dimensions (``graphopt optimize --input-shape``) lets exporters' shape arithmetic fold away."""
from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import numpy_helper

from graphopt.dsl import Pass
from graphopt.ir import STANDARD_DOMAIN, subgraphs_of, type_dims
from graphopt.vocabulary import attribute_default

MAX_FOLDED_ELEMENTS = 4096  # keep weights out: folding Transpose(W) would duplicate them
NOT_FOLDED = frozenset({"Constant", "RandomNormal", "RandomNormalLike", "RandomUniform",
                        "RandomUniformLike", "Multinomial", "Bernoulli", "Dropout"})


# onnx.reference evaluates these with their opset-13 semantics whatever the opset (before 13
# they coerce the input to 2-D at ``axis``), so folding them there would change the values.
REFERENCE_WRONG_BEFORE_13 = frozenset({"Softmax", "LogSoftmax", "Hardmax"})


def _outputs_small_enough(node, inputs: dict, opset: int) -> bool:
    """Whether ONNX shape inference, given the input values, proves every output holds at
    most MAX_FOLDED_ELEMENTS elements. Decided before evaluating: ConstantOfShape([1<<29]),
    Range, Tile or Expand of a few small constants would otherwise allocate gigabytes just
    to be thrown away. An output whose shape inference cannot pin down is not folded."""
    try:
        schema = onnx.defs.get_schema(node.op_type, opset, STANDARD_DOMAIN)
        types = {n: onnx.helper.make_tensor_type_proto(
            onnx.helper.np_dtype_to_tensor_dtype(v.dtype), v.shape) for n, v in inputs.items()}
        data = {n: numpy_helper.from_array(v, n) for n, v in inputs.items()}
        outputs = onnx.shape_inference.infer_node_outputs(
            schema, node, types, data,
            opset_imports=[onnx.helper.make_opsetid(STANDARD_DOMAIN, opset)])
    except Exception:  # no schema, or inference refuses the node: leave it alone
        return False
    for name in node.output:
        if not name:
            continue
        tp = outputs.get(name)
        dims = type_dims(tp) if tp is not None and tp.HasField("tensor_type") else None
        if dims is None or not all(isinstance(d, int) and d >= 0 for d in dims):
            return False
        if math.prod(dims) > MAX_FOLDED_ELEMENTS:
            return False
    return True


def _evaluate(graph, node):
    from onnx.reference import ReferenceEvaluator

    inputs = {name: graph.constant_value(name, MAX_FOLDED_ELEMENTS)
              for name in node.input if name}
    if any(v is None for v in inputs.values()):
        return None
    opset = graph.model.opset(STANDARD_DOMAIN) or 1
    if opset < 13 and node.op_type in REFERENCE_WRONG_BEFORE_13:
        return None
    if not _outputs_small_enough(node, inputs, opset):
        return None
    single = onnx.helper.make_graph(
        [node], "fold",
        [onnx.helper.make_tensor_value_info(n, onnx.helper.np_dtype_to_tensor_dtype(v.dtype),
                                            v.shape) for n, v in inputs.items()],
        [onnx.helper.make_tensor_value_info(o, onnx.TensorProto.UNDEFINED, None)
         for o in node.output if o])
    model = onnx.helper.make_model(single, opset_imports=[onnx.helper.make_opsetid("", opset)])
    try:
        return ReferenceEvaluator(model).run(None, inputs)
    except Exception:  # an op the reference cannot evaluate simply stays as it is
        return None


def _static_shape(graph, node) -> list | None:
    """The value of a Shape (start/end applied) or Size node whose input's dims are all
    known numbers; None otherwise."""
    if node.op_type not in ("Shape", "Size") or not node.input:
        return None
    tensor_type = graph.type_of(node.input[0])
    if tensor_type is None and graph.model.infer_types():
        tensor_type = graph.type_of(node.input[0])
    dims = type_dims(tensor_type) if tensor_type is not None else None
    if dims is None or not all(isinstance(d, int) for d in dims):
        return None
    if node.op_type == "Size":
        return [np.array(int(np.prod(dims, dtype=np.int64)), np.int64)]
    attrs = {a.name: a.i for a in node.attribute}
    start = attrs.get("start", attribute_default("Shape", "start"))
    end = attrs.get("end", len(dims))  # (no default: the rank)
    return [np.array(dims[slice(start, end)], np.int64)]


def fold(graph, report) -> int:
    folded = 0
    for node_id in graph.sorted_ids():
        key = graph.op_key(node_id)
        if (key is None or key[0] != STANDARD_DOMAIN or key[1] in NOT_FOLDED
                or not graph.inputs_of(node_id)):
            continue
        node = graph.node(node_id)
        if any(True for _ in subgraphs_of(node)) or any(graph.is_output(o) for o in node.output):
            continue
        values = _static_shape(graph, node)
        if values is None:
            if not all(name and graph.constant_value(name, MAX_FOLDED_ELEMENTS) is not None
                       for name in node.input):
                continue
            values = _evaluate(graph, node)
        if values is None or any(np.asarray(v).size > MAX_FOLDED_ELEMENTS for v in values):
            continue
        outputs = [o for o in node.output if o]
        graph.remove_node(node_id)
        for name, value in zip(outputs, values, strict=True):
            graph.add_initializer(numpy_helper.from_array(np.asarray(value), name))
        graph.remove_dead(node.input)
        folded += 1
    return folded


PASS = Pass(
    name="fold_constants",
    description="Nodes computing small constants from constants -> initializers",
    level=1,
    tags=("cleanup",),
    run=fold,
)

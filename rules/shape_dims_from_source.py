"""``Gather(Shape(t), i)`` -> ``Gather(Shape(s), k)`` where dimension i of t provably is
dimension k of an earlier tensor s (rules/_dims.py follows it there), so that the batch and
sequence sizes an exporter reads off a different tensor at every layer become one value read
off one tensor, which eliminate_common_subexpressions then computes once, with every
Unsqueeze and Concat built from it.

TorchScript's Falcon and GPT-2 exports read ``x.size(0)`` and ``x.size(1)`` before each view:
at every layer a Shape of the layer's own tensor (the fused QKV projection, a Split piece,
the attention output), so ONNX Runtime's common-subexpression elimination, which compares
input names, merges nothing across layers and little within one. Each followed step is exact
(see rules/_dims.py); a dimension whose size is known is fold_shapes' to fold. An existing
``Shape(s)`` placed before the Gather is reused; otherwise a new one is made (and merged
with its twins). Only the main graph's tensors, or a subgraph's own, are read: a subgraph's
new reader of an outer tensor would be invisible to the outer graph's index.
"""
from __future__ import annotations

import numpy as np
import onnx
from onnx import numpy_helper

from graphopt.dsl import Pass
from graphopt.ir import STANDARD_DOMAIN

from ._dims import DimOrigins


def _shape_positions(graph, shape_id: int, rank: int) -> list[int]:
    # Shape's start (default 0) and end (default: the rank) clamp as a Python slice does
    return list(range(rank))[graph.attr(shape_id, "start"):graph.attr(shape_id, "end")]


def _source(graph, origins: DimOrigins, gather_id: int):
    """(s, the positions k, the index array's shape) when every dimension the Gather picks
    has its origin in one earlier tensor s; None otherwise."""
    inputs = graph.inputs_of(gather_id)
    shape_id = graph.producer_of(inputs[0])
    if shape_id is None or graph.op_key(shape_id) != (STANDARD_DOMAIN, "Shape"):
        return None
    tensor = graph.inputs_of(shape_id)[0]
    rank = origins.rank(tensor)
    indices = graph.constant_value(inputs[1], 64)
    if rank is None or indices is None or indices.dtype.kind not in "iu" or indices.ndim > 1:
        return None
    positions = _shape_positions(graph, shape_id, rank)
    picked = []
    for i in indices.reshape(-1).tolist():
        if not -len(positions) <= i < len(positions):
            return None  # out of range: the node fails at run time, leave it so
        picked.append(origins.dim(tensor, positions[i]))
    if not picked or any(not isinstance(p, tuple) for p in picked):
        return None  # unknown, or a known size: fold_shapes folds those
    source = picked[0][0]
    if any(p[0] != source for p in picked) or not graph.is_defined(source):
        return None
    ks = [p[1] for p in picked]
    if source == tensor and ks == [positions[i] for i in indices.reshape(-1).tolist()] \
            and positions == list(range(rank)):
        return None  # already read off its origin
    return source, ks, indices.shape


def _shape_of(graph, source: str, before: tuple) -> str | None:
    """The output of a whole-shape Shape(source) placed before ``before``, if there is one."""
    for reader in graph.consumers_of(source):
        if graph.op_key(reader) == (STANDARD_DOMAIN, "Shape") \
                and graph.attr(reader, "start") is None and graph.attr(reader, "end") is None \
                and graph.order_of(reader) < before:
            return graph.outputs_of(reader)[0]
    return None


def _new_node(graph, op_type: str, inputs, outputs, hint: str):
    node = graph.new_node(onnx.helper.make_node(op_type, [], []))
    node.name = graph.model.names.fresh(hint)
    node.input.extend(inputs)
    node.output.extend(outputs)
    return node


def rewire(graph, report) -> int:
    origins = DimOrigins(graph)
    names = graph.model.names
    changed = 0
    for gather_id in sorted(graph.nodes_of_type("Gather"), key=graph.order_of):
        if not graph.has_node(gather_id):
            continue
        found = _source(graph, origins, gather_id)
        if found is None:
            continue
        source, ks, index_shape = found
        order, old_inputs = graph.order_of(gather_id), graph.inputs_of(gather_id)
        output = graph.outputs_of(gather_id)[0]
        stem = graph.name_of(gather_id) or "shape_dims_from_source"
        shape = _shape_of(graph, source, order)
        graph.remove_node(gather_id)
        if shape is None:
            shape = names.fresh(f"{source}/shape")
            graph.add_node(_new_node(graph, "Shape", [source], [shape], f"{stem}/Shape"),
                           order + (0,))
            graph.set_type(shape, onnx.helper.make_tensor_type_proto(
                onnx.TensorProto.INT64, [origins.rank(source)]))
        index = names.fresh(f"{source}/dims")
        graph.add_initializer(numpy_helper.from_array(
            np.array(ks, np.int64).reshape(index_shape), index))
        graph.add_node(_new_node(graph, "Gather", [shape, index], [output], f"{stem}/Gather"),
                       order + (1,))   # (axis 0, Gather's default)
        graph.remove_dead(old_inputs)
        changed += 1
    return changed


PASS = Pass(
    name="shape_dims_from_source",
    description="Gather(Shape(t), i) -> Gather(Shape(s), k) when dim i of t is dim k of an "
                "earlier s",
    level=1,
    tags=("canonicalize",),
    run=rewire,
)

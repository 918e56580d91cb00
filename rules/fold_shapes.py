"""Shape arithmetic on dimensions that are known -> constants.

``Shape(x)`` and ``Size(x)`` of a tensor whose shape is static become initializers; so do
``Gather`` and ``Slice`` of a ``Shape(x)`` when the dimensions they pick are static, even if
other dimensions of ``x`` are symbolic (batch, sequence). fold_constants then folds what is
computed from them. This is how the attention scale of HF's SDPA export,
``Shape(q)[-1:] -> Cast -> Sqrt -> Div(1, .)``, becomes a constant the FusedMatMul fusion can
take, and how the Slice bounds of ``chunk(3, -1)`` on a dynamic export, computed from
``Shape(fused_qkv)[-1]``, become constants the Split fusion can read (the last axis of the
fused projection has a fixed size). ONNX Runtime folds Shape only when every dimension is
static.

Shapes come from the model's declared types and ONNX shape inference (Graph.static_shape).
The model's inference runs once per optimization, but every constant folded can make more
dimensions static (a Reshape whose shape became a constant), so each run of this pass first
refines the known types with a fresh inference: without that, a second optimization of the
result would still find work (not a fixpoint).
"""
from __future__ import annotations

import math
import weakref

import numpy as np
import onnx
from onnx import numpy_helper

from graphopt.dsl import Pass
from graphopt.inference import infer_shapes as bounded_infer_shapes
from graphopt.ir import STANDARD_DOMAIN, type_dims

from ._dims import DimOrigins


def _dims(graph, tensor: str, origins: DimOrigins) -> list[int | None] | None:
    """The tensor's dims: known by inference, or by following them to their origin (a size
    inference lost behind a contrib op, such as the 64 of a Reshape after a FusedMatMul)."""
    shape = graph.static_shape(tensor)
    if shape is None:
        return None
    return [d if d is not None or not isinstance(origins.dim(tensor, i), int)
            else origins.dim(tensor, i) for i, d in enumerate(shape)]


def _shape_range(graph, node_id: int, rank: int) -> list[int]:
    """The positions Shape(start, end) (opset 15) reads; the whole shape before that. Start
    (default 0) and end (default: the rank) clamp as a Python slice does."""
    return list(range(rank))[graph.attr(node_id, "start"):graph.attr(node_id, "end")]


def _shape_of(graph, node_id: int, origins: DimOrigins):
    """(tensor whose shape this Shape node reads, positions of the dims it returns)."""
    source = graph.inputs_of(node_id)[0]
    dims = _dims(graph, source, origins)
    if dims is None:
        return None, None, None
    return source, dims, _shape_range(graph, node_id, len(dims))


def _static(dims, positions) -> np.ndarray | None:
    picked = [dims[p] for p in positions]
    if any(d is None for d in picked):
        return None
    return np.array(picked, dtype=np.int64)


def _picked_positions(graph, node, positions: list[int]) -> np.ndarray | None:
    """What a Gather/Slice reading Shape(x) picks, as positions into x's shape: the node run
    (by the ONNX reference) on the positions instead of the dims, so every index rule of the
    op (negative, clamped, stepped) is the reference's own."""
    from onnx.reference import ReferenceEvaluator

    feeds = {node.input[0]: np.array(positions, dtype=np.int64)}
    for name in node.input[1:]:
        if not name:
            continue
        value = graph.constant_value(name, 64)
        if value is None:
            return None
        feeds[name] = value
    opset = graph.model.opset(STANDARD_DOMAIN)   # (a model with a Shape imports it)
    single = onnx.helper.make_graph(
        [node], "picked",
        [onnx.helper.make_tensor_value_info(n, onnx.helper.np_dtype_to_tensor_dtype(v.dtype),
                                            v.shape) for n, v in feeds.items()],
        [onnx.helper.make_tensor_value_info(node.output[0], onnx.TensorProto.INT64, None)])
    model = onnx.helper.make_model(single, opset_imports=[onnx.helper.make_opsetid("", opset)])
    try:
        (picked,) = ReferenceEvaluator(model).run(None, feeds)
    except Exception:  # an index out of range and the like: the node stays as it is
        return None
    return np.asarray(picked)


def _value(graph, node_id: int, origins: DimOrigins):
    """The constant a Shape/Size (or a Gather/Slice of a Shape) computes, or None."""
    op_type = graph.op_key(node_id)[1]
    if op_type == "Shape":
        _, dims, positions = _shape_of(graph, node_id, origins)
        return None if dims is None else _static(dims, positions)
    if op_type == "Size":
        dims = _dims(graph, graph.inputs_of(node_id)[0], origins)
        if dims is None or any(d is None for d in dims):
            return None
        count = math.prod(int(d) for d in dims)   # exact: np.prod wraps around in int64
        if count > INT64_MAX:
            return None   # no int64 holds it: the Size stays, as ONNX says it would be
        return np.array(count, dtype=np.int64)
    source = graph.producer_of(graph.inputs_of(node_id)[0])
    if source is None or graph.op_key(source) != (STANDARD_DOMAIN, "Shape"):
        return None
    _, dims, positions = _shape_of(graph, source, origins)
    if dims is None:
        return None
    picked = _picked_positions(graph, graph.node(node_id), list(range(len(positions))))
    if picked is None:
        return None
    values = [dims[positions[int(i)]] for i in picked.reshape(-1)]
    if any(d is None for d in values):
        return None
    return np.array(values, dtype=np.int64).reshape(picked.shape)


def _more_static(old: onnx.TypeProto, new: onnx.TypeProto) -> bool:
    """``new`` says the same as ``old`` and knows more dims (never a conflicting one)."""
    old_dims, new_dims = type_dims(old), type_dims(new)
    if new_dims is None or old.tensor_type.elem_type != new.tensor_type.elem_type:
        return False
    if old_dims is None:
        return True
    if len(old_dims) != len(new_dims):
        return False
    gained = False
    for was, now in zip(old_dims, new_dims, strict=True):
        if isinstance(was, int):
            if was != now:
                return False
        elif isinstance(now, int):
            gained = True
    return gained


def refine_types(graph) -> None:
    """The main graph's types, refined by ONNX inference (with data propagation) of the model
    as it is now; through set_type, so a rollback undoes it."""
    if graph is not graph.model.graph:
        return  # a subgraph's types come with the main graph's inference
    try:
        inferred = bounded_infer_shapes(graph.model.flush())
    except (onnx.shape_inference.InferenceError, onnx.checker.ValidationError):
        return
    for vi in inferred.graph.value_info:
        name, new = vi.name, vi.type
        if not new.HasField("tensor_type") or not graph.has_tensor(name):
            continue
        old = graph.type_of(name)
        if old is None or _more_static(old, new):
            graph.set_type(name, new)


FOLDED = ("Shape", "Size", "Gather", "Slice")
INT64_MAX = (1 << 63) - 1


# graph -> (nodes, initializers) when its types were last refined: folds change both counts
_REFINED_AT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _refine_if_folded(graph) -> None:
    """Refine the types when something was folded since the last refinement (by this pass
    or by fold_constants): a Slice whose bounds just became constants has a static output.
    A fold always changes the counts (one node fewer, one initializer more)."""
    snapshot = (graph.node_count(), graph.initializer_count())
    if _REFINED_AT.get(graph) != snapshot:
        refine_types(graph)
        _REFINED_AT[graph] = (graph.node_count(), graph.initializer_count())


def fold(graph, report) -> int:
    has_shapes = graph.nodes_of_type("Shape") or graph.nodes_of_type("Size")
    if not has_shapes and graph not in _REFINED_AT:
        return 0  # nothing to fold, nothing folded before: the first inference holds
    _refine_if_folded(graph)
    candidates = [i for op_type in FOLDED for i in graph.nodes_of_type(op_type)]
    origins = DimOrigins(graph)
    folded = 0
    for node_id in sorted(candidates, key=graph.order_of):
        if not graph.has_node(node_id):
            continue
        outputs = graph.outputs_of(node_id)   # (none of the FOLDED ops holds a subgraph)
        if len(outputs) != 1 or graph.is_output(outputs[0]):
            continue
        value = _value(graph, node_id, origins)
        if value is None:
            continue
        inputs = graph.inputs_of(node_id)
        graph.remove_node(node_id)
        graph.add_initializer(numpy_helper.from_array(value, outputs[0]))
        graph.remove_dead(inputs)
        folded += 1
    if folded:  # what this run folded shapes the tensors the rules after it look at
        _refine_if_folded(graph)
    return folded


PASS = Pass(
    name="fold_shapes",
    description="Shape/Size of known dims, and Gather/Slice of their static dims -> constants",
    level=1,
    tags=("cleanup",),
    run=fold,
)

"""The checks a rewrite must pass: local ones on each node it adds (inputs defined and
produced before it, the op exists at the model's opset, ONNX per-node inference agrees
with the types known), and the whole-model check (ONNX checker + strict shape inference).
A failed local check raises RewriteRejected; the caller rolls the rewrite back."""
from __future__ import annotations

import contextlib
import threading

import onnx

from .errors import RewriteRejected
from .inference import weight_free_view, weight_free_view_differs
from .ir import STANDARD_DOMAIN, Graph, Model, external_tensors


def check_inputs(model: Model, graph: Graph, inputs, order: tuple) -> None:
    """The inputs of a node to be put at ``order`` exist and are produced before it (a
    node replaced in place has that order itself, so its outputs are refused too)."""
    producer_of, order_of = graph.producer_of, graph.order_of
    in_main_graph = graph is model.graph
    for name in inputs:
        if not name:
            continue
        producer = producer_of(name)
        if producer is not None:
            if order_of(producer) >= order:
                raise RewriteRejected(f"'{name}' would be used before it is produced")
        elif in_main_graph and not graph.is_initializer(name) \
                and not graph.is_graph_input(name):
            raise RewriteRejected(f"'{name}' is not defined in the graph")


def check_new_node(model: Model, graph: Graph, node_id: int) -> None:
    """Local checks of a node a rewrite added: its inputs exist and come before it, and
    standard-domain nodes pass ONNX per-node inference agreeing with known types."""
    check_inputs(model, graph, graph.inputs_of(node_id), graph.order_of(node_id))
    if graph.op_key(node_id)[0] == STANDARD_DOMAIN:
        infer(graph, graph.node(node_id), model.opset(STANDARD_DOMAIN) or 1)


def check_outputs_kept(graph: Graph, replaced) -> None:
    """No graph output among the ``replaced`` tensors is left without a producer."""
    for old in replaced:
        if graph.is_output(old) and not graph.is_defined(old):
            raise RewriteRejected(f"graph output '{old}' would lose its producer")


def infer(graph: Graph, node: onnx.NodeProto, opset: int) -> None:
    """Per-node ONNX inference with the input types we know; must agree with old types."""
    try:
        schema = onnx.defs.get_schema(node.op_type, opset, STANDARD_DOMAIN)
    except onnx.defs.SchemaError:
        raise RewriteRejected(f"{node.op_type} does not exist at opset {opset}") from None
    inputs = list(node.input)
    # the types compared and propagated are inferred ones, not declarations
    graph.verify_declared([*inputs, *node.output])
    known = {}
    for name in inputs:
        known_type = graph.type_of(name) if name else None
        if known_type is not None:
            known[name] = known_type
        elif name:
            elem = graph.elem_type(name)
            shape = graph.static_shape(name)
            if elem is None:
                return  # partial knowledge: the final whole-model check decides
            known[name] = onnx.helper.make_tensor_type_proto(elem, shape)
    try:
        inferred = onnx.shape_inference.infer_node_outputs(
            schema, node, known,
            {n: graph.initializer(n) for n in inputs if graph.is_initializer(n)})
    except (onnx.shape_inference.InferenceError, RuntimeError) as exc:
        raise RewriteRejected(f"{node.op_type} '{node.name}': "
                              f"{str(exc).strip().splitlines()[0]}") from None
    for out, type_proto in inferred.items():
        old = graph.type_of(out)
        if old is None:
            graph.set_type(out, type_proto)
        elif not _compatible(old, type_proto):
            raise RewriteRejected(f"'{out}' would change type/shape from "
                                  f"{_type_str(old)} to {_type_str(type_proto)}")


def _compatible(old: onnx.TypeProto, new: onnx.TypeProto) -> bool:
    if not (old.HasField("tensor_type") and new.HasField("tensor_type")):
        return True
    a, b = old.tensor_type, new.tensor_type
    if a.elem_type and b.elem_type and a.elem_type != b.elem_type:
        return False
    if a.HasField("shape") and b.HasField("shape"):
        if len(a.shape.dim) != len(b.shape.dim):
            return False
        for x, y in zip(a.shape.dim, b.shape.dim, strict=True):
            if x.HasField("dim_value") and y.HasField("dim_value") and x.dim_value != y.dim_value:
                return False
    return True


def _type_str(tp: onnx.TypeProto) -> str:
    t = tp.tensor_type
    dims = [str(d.dim_value) if d.HasField("dim_value") else (d.dim_param or "?")
            for d in t.shape.dim] if t.HasField("shape") else ["?"]
    return f"{onnx.helper.tensor_dtype_to_string(t.elem_type)}[{','.join(dims)}]"


_CWD_LOCK = threading.Lock()


def check_structure(proto: onnx.ModelProto, base_dir: str = "") -> None:
    """The ONNX checker on the model without its large weights' bytes (as graph inputs of
    their types: :func:`graphopt.inference.weight_free_view`), so checking costs what the
    graph costs, not the weights. What it leaves out, the tensors' own bytes, the loader
    checks (inline sizes, external data extents and files) once. External data the view
    still holds (in local functions, sparse initializers, Constant nodes, subgraphs) is
    checked by ONNX in the model's folder, ``base_dir``."""
    _check_view(_checkable(proto), base_dir)


def _checkable(proto: onnx.ModelProto) -> onnx.ModelProto:
    """The model the checker is given: without its large weights' bytes when it has any (a
    model without them is checked as it is: a view would be a copy of every node for
    nothing)."""
    if not any(weight_free_view_differs(t) for t in proto.graph.initializer):
        return proto
    view, _ = weight_free_view(proto, for_checker=True)
    return view


def _check_view(view: onnx.ModelProto, base_dir: str) -> None:
    if base_dir and external_tensors(view):
        # The checker finds external data relative to the working directory when it is given
        # a proto rather than a path; the model's own folder is the right base.
        with _CWD_LOCK, contextlib.chdir(base_dir):
            onnx.checker.check_model(view)
    else:
        onnx.checker.check_model(view)


def validate(model: Model) -> None:
    """Whole-model check: the ONNX checker and strict shape inference, on the model without
    its large weights' bytes (:func:`check_structure`)."""
    view = _checkable(model.flush())
    _check_view(view, model.base_dir)
    onnx.shape_inference.infer_shapes(view, strict_mode=True)

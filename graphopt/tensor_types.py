"""The type-and-shape service: the element type and shape of every tensor of a model, the one
way graphopt's engine, its training-graph builder and the executor's memory guard learn them.

It is ONNX shape inference, bounded and run on the model without its weights' bytes
(:mod:`graphopt.inference`), completed for the com.microsoft ops graphopt writes, which ONNX
knows nothing of:

* the ops whose output is typed as one of their inputs (:data:`TYPE_OF_INPUT`: Gelu and
  friends) stand in as Identity nodes while inference runs (:func:`contrib_stand_ins`), so
  everything computed from them is typed too, Shape values included;
* the outputs of LayerNormalizationGrad and ConvGrad are typed as the inputs they are the
  gradients of (:data:`OUTPUTS_TYPED_AS_INPUTS`);
* FusedMatMul's output is computed from its operands' shapes after its flags'
  permutations (:func:`fused_matmul_permutation`, the one statement of what transA/transB/
  transBatchA/transBatchB mean, which the executor's kernel applies to arrays), and the
  standard nodes after it by per-node inference, in graph order.
"""
from __future__ import annotations

import contextlib
import itertools
from collections.abc import Mapping, Sequence

import onnx

from .inference import infer_shapes, weight_free_view
from .vocabulary import (
    MS_DOMAIN,
    OPS_WITH_SUBGRAPHS,
    STANDARD_DOMAIN,
    normalize_domain,
    subgraphs_of,
    type_dims,
)

# com.microsoft ops whose one output has the type and shape of one of their inputs (its index)
# (BiasGelu's bias is a vector along its input's last axis, as ONNX Runtime requires). The
# gradient ops are typed by the forward tensor they differentiate: ReluGrad(dY, X),
# SoftmaxGrad(dY, Y), SoftmaxCrossEntropyLossGrad(dY, log_prob, label, ...) -> d_logits; an
# untyped backward pass would hide every rank-guarded fusion after them
TYPE_OF_INPUT = {"Gelu": 0, "GeluGrad": 1, "FastGelu": 0, "FastGeluGrad": 1, "BiasGelu": 0,
                 "BiasGeluGrad_dX": 1, "ReluGrad": 1, "SoftmaxGrad": 1, "SoftmaxGrad_13": 1,
                 "LogSoftmaxGrad": 1, "LogSoftmaxGrad_13": 1, "SoftmaxCrossEntropyLossGrad": 1,
                 "DropoutGrad": 0, "BatchNormInternal": 0}
# com.microsoft ops of several outputs, each typed as one of the inputs: {output: input}
# (LayerNormalizationGrad(dY, X, scale, mean, inv_std) -> dX, dscale, dbias; ConvGrad(dY, X,
# W) -> dX, dW and dB, whose shape no input has; BatchNormInternal(X, scale, B, mean, var) ->
# Y and four per-channel statistics, BatchNormalizationGrad(dY, X, scale, mean, inv_std) ->
# dX, dscale, dB)
OUTPUTS_TYPED_AS_INPUTS = {"LayerNormalizationGrad": {0: 1, 1: 2, 2: 2},
                           "ConvGrad": {0: 1, 1: 2},
                           "BatchNormInternal": {0: 0, 1: 3, 2: 3, 3: 3, 4: 3},
                           "BatchNormalizationGrad": {0: 1, 1: 2, 2: 2}}


def infer_types(model: onnx.ModelProto,
                input_shapes: Mapping[str, Sequence[int]] | None = None
                ) -> dict[str, onnx.TypeProto]:
    """name -> type of the tensors inference types (value_info and outputs, subgraphs
    included), completed after the com.microsoft ops. Inference starts from the graph's
    inputs alone: the model's value_info and output shapes are claims, not facts (a
    value_info can say [2,6,4] where the inputs give [B,S,4]), and are hidden from it, so a
    declaration that lies cannot leak into the result; the optimizer, the gradient builder
    and the memory guard all see the same types. ``input_shapes``: graph inputs' dims to
    infer with instead of the declared ones (the model is not changed). Raises what ONNX
    inference raises."""
    if input_shapes:
        model = _with_input_shapes(model, input_shapes)
    hidden = _hide_declarations(model.graph)
    try:
        with contrib_stand_ins(model):
            inferred = infer_shapes(model)
    finally:
        _restore_declarations(hidden)
    found: dict[str, onnx.TypeProto] = {}
    _collect(inferred.graph, found)
    complete_after_contrib_ops(inferred, found)
    return found


def _hide_declarations(graph: onnx.GraphProto) -> list:
    """Take out every value_info and output shape of ``graph`` and its subgraphs (undone by
    _restore_declarations): the whole-model proto is not copied, weights included."""
    hidden = [(graph, list(graph.value_info), [
        (out, onnx.TypeProto.FromString(out.type.SerializeToString())) for out in graph.output
        if out.type.HasField("tensor_type") and out.type.tensor_type.HasField("shape")])]
    del graph.value_info[:]
    for out, _ in hidden[0][2]:
        out.type.tensor_type.ClearField("shape")
    for node in graph.node:
        for sub in subgraphs_of(node):
            hidden.extend(_hide_declarations(sub))
    return hidden


def _restore_declarations(hidden: list) -> None:
    for graph, value_info, outputs in hidden:
        del graph.value_info[:]
        graph.value_info.extend(value_info)
        for out, tp in outputs:
            out.type.CopyFrom(tp)


def _with_input_shapes(model: onnx.ModelProto, shapes: Mapping[str, Sequence[int]]
                       ) -> onnx.ModelProto:
    """A model to infer with: ``model`` without its weights' bytes (the view inference reads
    anyway) or value_info, with the given inputs' dims."""
    probe, _ = weight_free_view(model)
    del probe.graph.value_info[:]
    for vi in probe.graph.input:
        dims = shapes.get(vi.name)
        if dims is None or not vi.type.HasField("tensor_type"):
            continue
        vi.type.tensor_type.ClearField("shape")
        for d in dims:
            vi.type.tensor_type.shape.dim.add().dim_value = int(d)
    return probe


def _collect(graph: onnx.GraphProto, found: dict) -> None:
    for vi in itertools.chain(graph.value_info, graph.output):
        if vi.type.HasField("tensor_type"):
            found.setdefault(vi.name, vi.type)
    for node in graph.node:
        for sub in subgraphs_of(node):
            _collect(sub, found)


@contextlib.contextmanager
def contrib_stand_ins(model: onnx.ModelProto):
    """Inside, the main graph's TYPE_OF_INPUT nodes are Identity nodes of the input whose type
    they have, so ONNX shape inference (which knows no com.microsoft op) types their output
    and everything computed from it, Shape values included (data propagation); the nodes are
    put back on leaving. In place: the model, weights and all, is not copied."""
    swapped = []
    for node in model.graph.node:
        index = TYPE_OF_INPUT.get(node.op_type)
        if (index is None or normalize_domain(node.domain) != MS_DOMAIN
                or len(node.input) <= index or not node.input[index]):
            continue
        swapped.append((node, node.SerializeToString()))
        source = node.input[index]
        del node.input[:], node.output[1:], node.attribute[:]
        node.input.append(source)
        node.op_type = "Identity"
        node.ClearField("domain")  # the standard domain
    try:
        yield model
    finally:
        for node, original in swapped:
            node.ParseFromString(original)


# ---- FusedMatMul --------------------------------------------------------------------------
def fused_matmul_permutation(rank: int, trans_batch: bool, trans: bool) -> list[int] | None:
    """The axes FusedMatMul reads an operand of ``rank`` in: ``transBatch`` moves axis 0 to
    just before the last axis, then ``trans`` swaps the last two. None where a flag is set on
    a vector (what ONNX Runtime does then is not specified)."""
    axes = list(range(rank))
    if (trans or trans_batch) and rank < 2:
        return None
    if trans_batch and rank >= 3:
        axes = [*axes[1:-1], axes[0], axes[-1]]
    if trans:
        axes[-2], axes[-1] = axes[-1], axes[-2]
    return axes


def fused_matmul_operand_dims(dims: Sequence, trans_batch: bool, trans: bool) -> list | None:
    """An operand's dims as FusedMatMul multiplies them (:func:`fused_matmul_permutation`)."""
    axes = fused_matmul_permutation(len(dims), trans_batch, trans)
    return None if axes is None else [dims[axis] for axis in axes]


def _fused_matmul_type(node: onnx.NodeProto, known: dict) -> dict:
    """{output: type} of a FusedMatMul: the MatMul of its permuted operands (broadcasting as
    MatMul's does, so by ONNX's own MatMul inference)."""
    dims = []
    for index, side in ((0, "A"), (1, "B")):
        shape = type_dims(known[node.input[index]])
        if shape is None:
            return {}
        flags = {a.name: a.i for a in node.attribute}
        permuted = fused_matmul_operand_dims(shape, bool(flags.get(f"transBatch{side}", 0)),
                                             bool(flags.get(f"trans{side}", 0)))
        if permuted is None:
            return {}
        dims.append(permuted)
    elem = known[node.input[0]].tensor_type.elem_type
    matmul = onnx.helper.make_node("MatMul", ["a", "b"], ["y"])
    try:
        inferred = onnx.shape_inference.infer_node_outputs(
            onnx.defs.get_schema("MatMul", 13), matmul,
            {"a": onnx.helper.make_tensor_type_proto(elem, dims[0]),
             "b": onnx.helper.make_tensor_type_proto(elem, dims[1])})
    except (onnx.shape_inference.InferenceError, RuntimeError):
        return {}
    return {node.output[0]: inferred["y"]} if "y" in inferred else {}


# ---- after the contrib ops ----------------------------------------------------------------
def complete_after_contrib_ops(model: onnx.ModelProto, found: dict) -> None:
    """ONNX inference knows no com.microsoft op, so the outputs of the FusedMatMuls the
    fusions make, and everything computed from them, come back untyped; optimizing the
    result again would then see less than the run that made it (and a rule guarded by a
    rank would decide differently). Types FusedMatMul outputs (:func:`_fused_matmul_type`)
    and the standard-domain nodes downstream by per-node inference, in graph order (main
    graph only), into ``found``."""
    graph = model.graph
    opset = next((o.version for o in model.opset_import if normalize_domain(o.domain) == ""),
                 None)
    if opset is None:
        return
    known = dict(found)
    for tensor in graph.input:
        known.setdefault(tensor.name, tensor.type)
    for tensor in graph.initializer:
        known.setdefault(tensor.name, onnx.helper.make_tensor_type_proto(
            tensor.data_type, list(tensor.dims)))
    initializers = {t.name: t for t in graph.initializer}
    for node in graph.node:
        missing = [o for o in node.output if o and not _has_shape(known.get(o))]
        if not missing:
            continue
        domain = normalize_domain(node.domain)
        if domain == MS_DOMAIN and node.op_type in OUTPUTS_TYPED_AS_INPUTS:
            # typed by the inputs it names alone (its incoming gradient may be untyped)
            inferred = {node.output[out]: known[node.input[source]]
                        for out, source in OUTPUTS_TYPED_AS_INPUTS[node.op_type].items()
                        if out < len(node.output) and node.output[out]
                        and source < len(node.input) and node.input[source] in known}
        elif not all(i in known for i in node.input if i):
            continue
        elif domain == MS_DOMAIN and node.op_type == "FusedMatMul":
            inferred = _fused_matmul_type(node, known)
        elif domain == STANDARD_DOMAIN and node.op_type not in OPS_WITH_SUBGRAPHS[""]:
            try:
                schema = onnx.defs.get_schema(node.op_type, opset, STANDARD_DOMAIN)
                inferred = onnx.shape_inference.infer_node_outputs(
                    schema, node, {i: known[i] for i in node.input if i},
                    {i: initializers[i] for i in node.input if i in initializers})
            except (onnx.defs.SchemaError, onnx.shape_inference.InferenceError, RuntimeError):
                continue
        else:
            continue
        for name, type_proto in inferred.items():
            if name in missing and _has_shape(type_proto):
                known[name] = found[name] = type_proto


def _has_shape(type_proto: onnx.TypeProto | None) -> bool:
    """A tensor type with a rank (an output's hidden declaration leaves only its type)."""
    return type_proto is not None and type_proto.tensor_type.HasField("shape")

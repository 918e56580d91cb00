"""The words graphopt shares with ONNX and ONNX Runtime, each spelled once.

Domains, the training graph's YieldOp and backward-pass annotation, the float element types,
attribute defaults (read from the ONNX schemas, not written again where an attribute is
read), a tensor type's dims and a node's subgraphs. This is the lowest layer: it imports
only onnx, and every other layer (rules, graphopt.training, the executor, the trainer) takes
these names from here. tests/architecture/test_vocabulary.py fails when one of the literals
is spelled, one of these names defined, or an attribute default written by hand anywhere
else.
"""
from __future__ import annotations

import functools
from collections.abc import Iterator

import onnx

STANDARD_DOMAIN = ""
STANDARD_DOMAIN_ALIAS = "ai.onnx"  # the standard domain's other spelling in a model
MS_DOMAIN = "com.microsoft"  # ONNX Runtime's contrib ops (FusedMatMul, YieldOp, *Grad)

# Ops of the standard and com.microsoft domains that carry subgraphs; no other op of those
# domains does, which spares a scan of every node's attributes.
OPS_WITH_SUBGRAPHS = {"": frozenset({"If", "Loop", "Scan", "SequenceMap"}),
                       STANDARD_DOMAIN_ALIAS: frozenset({"If", "Loop", "Scan", "SequenceMap"}),
                       MS_DOMAIN: frozenset({"BeamSearch", "GreedySearch", "Sampling",
                                             "WhisperBeamSearch"})}


def normalize_domain(domain: str) -> str:
    return STANDARD_DOMAIN if domain in (STANDARD_DOMAIN, STANDARD_DOMAIN_ALIAS) else domain


def domain_label(domain: str) -> str:
    """How messages and tables name a domain: the standard one as ai.onnx."""
    return domain or STANDARD_DOMAIN_ALIAS


# ---- training graphs (ONNX Runtime's layout) -----------------------------------------------
YIELD_OP = "YieldOp"  # com.microsoft: hands the forward outputs over, their gradients back
# Set to 1 on the YieldOp and every node after it (the backward pass), 0 on forward nodes;
# ONNX Runtime's ROCm EP runs the marked GEMMs/convs with its FP16 alternate implementation.
BACKWARD_PASS_ATTRIBUTE = "__backwardpass"


def is_yield_op(node) -> bool:
    """A NodeProto (or anything with op_type and domain) is the training graph's YieldOp."""
    return node.op_type == YIELD_OP and normalize_domain(node.domain) == MS_DOMAIN


# ---- element types ---------------------------------------------------------------------------
FLOAT_TYPES = frozenset({onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE,
                         onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16})

# ---- attribute defaults -------------------------------------------------------------------
# The onnx package ships the standard schemas only; these are ONNX Runtime's contrib schemas
# (onnxruntime/core/graph/contrib_ops/contrib_defs.cc, orttraining/core/graph/
# training_op_defs.cc) for the com.microsoft ops whose defaults graphopt reads.
_CONTRIB_DEFAULTS = {
    "BatchNormInternal": {"epsilon": 1e-5, "momentum": 0.9, "training_mode": 1},
    "BatchNormalizationGrad": {"epsilon": 1e-5},
    "ConvGrad": {"group": 1},
    "FusedMatMul": {"alpha": 1.0, "transA": 0, "transB": 0, "transBatchA": 0,
                    "transBatchB": 0},
    "GatherGrad": {"axis": 0},
    "LayerNormalizationGrad": {"axis": -1},
    "ReduceSumTraining": {"keepdims": 1, "noop_with_empty_axes": 0},
    "Scale": {"scale_down": 0},
    "SoftmaxCrossEntropyLossInternal": {"reduction": b"mean"},
    "SoftmaxCrossEntropyLossGrad": {"reduction": b"mean"},
    "SoftmaxCrossEntropyLossInternalGrad": {"reduction": b"mean"},
    "SplitTraining": {"axis": 0},
}


def attribute_default(op_type: str, name: str, domain: str = STANDARD_DOMAIN,
                      opset: int | None = None):
    """The value attribute ``name`` of ``op_type`` takes when a node leaves it out, as the
    ONNX schema of ``opset`` gives it; the latest schema's without an opset, or when the op
    or the attribute is newer than ``opset`` (ONNX Runtime runs LayerNormalization before
    opset 17 defines it; a new attribute's default is the behaviour of the opsets before it,
    noop_with_empty_axes=0). KeyError if the attribute has no default. Floats are the
    schema's float32 values, strings bytes (as onnx.helper.get_attribute_value gives them)."""
    if normalize_domain(domain) == MS_DOMAIN:
        return _CONTRIB_DEFAULTS[op_type][name]
    value = _standard_default(op_type, name, opset)
    return list(value) if isinstance(value, tuple) else value


def attribute_or_default(node, name: str, opset: int | None = None):
    """A NodeProto's attribute ``name``, or the schema's default where the node leaves it
    out (:func:`attribute_default`); strings as bytes, as onnx.helper gives them."""
    for attribute in node.attribute:
        if attribute.name == name:
            return onnx.helper.get_attribute_value(attribute)
    return attribute_default(node.op_type, name, node.domain or STANDARD_DOMAIN, opset)


def attribute_defaults(op_type: str, domain: str = STANDARD_DOMAIN) -> dict:
    """Every attribute of ``op_type`` that has a default, with it (latest schema); none for
    a com.microsoft op the table above does not list, or an op of another domain."""
    domain = normalize_domain(domain)
    if domain != STANDARD_DOMAIN:
        return dict(_CONTRIB_DEFAULTS.get(op_type, {})) if domain == MS_DOMAIN else {}
    return {name: attribute_default(op_type, name) for name, attribute
            in onnx.defs.get_schema(op_type, STANDARD_DOMAIN).attributes.items()
            if attribute.default_value.type != onnx.AttributeProto.UNDEFINED}


@functools.cache
def _standard_default(op_type: str, name: str, opset: int | None):
    schema = None
    if opset is not None:
        try:
            schema = onnx.defs.get_schema(op_type, opset, STANDARD_DOMAIN)
        except onnx.defs.SchemaError:
            pass
    if schema is None or name not in schema.attributes:
        schema = onnx.defs.get_schema(op_type, STANDARD_DOMAIN)
    default = schema.attributes[name].default_value
    if default.type == onnx.AttributeProto.UNDEFINED:
        raise KeyError(f"{op_type}.{name} has no default (opset {opset or 'latest'})")
    value = onnx.helper.get_attribute_value(default)
    return tuple(value) if isinstance(value, list) else value  # cached: kept immutable


def subgraphs_of(node: onnx.NodeProto) -> Iterator[onnx.GraphProto]:
    """The graphs a node holds in its attributes (If branches, Loop and Scan bodies)."""
    for attr in node.attribute:
        if attr.type == onnx.AttributeProto.GRAPH:
            yield attr.g
        elif attr.type == onnx.AttributeProto.GRAPHS:
            yield from attr.graphs


def type_dims(type_proto: onnx.TypeProto) -> list[int | str | None] | None:
    """A tensor type's dims: an int, a symbol or None (unknown) each; None without a shape."""
    tensor_type = type_proto.tensor_type
    if not tensor_type.HasField("shape"):
        return None
    dims: list[int | str | None] = []
    for dim in tensor_type.shape.dim:
        if dim.HasField("dim_value"):
            dims.append(dim.dim_value)
        elif dim.HasField("dim_param"):
            dims.append(dim.dim_param)
        else:
            dims.append(None)
    return dims

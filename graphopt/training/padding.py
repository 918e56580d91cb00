"""Embedding padding rows: the row of an embedding that its lookups send no gradient to,
as ``nn.Embedding(padding_idx=N)`` keeps it.

Exporters write the lookup as a plain Gather and drop ``padding_idx``; the dynamo exporter
still says it in the node's ``pkg.torch.onnx.fx_node`` metadata (``aten.embedding.default``
called with the weight, the indices and the padding index). A TorchScript export keeps no
trace of it: ``--padding-idx N`` names it for the lookups of token ids (a Gather on axis 0 of
a float initializer, indexed by a graph input). Only the lookups' contribution is dropped: a
tied output projection still trains the row, as autograd does.
"""
from __future__ import annotations

import re

import onnx

from ..errors import GraphoptError
from ..vocabulary import FLOAT_TYPES, STANDARD_DOMAIN, attribute_or_default, normalize_domain
from .shared import fx_node_text

# call_function[target=torch.ops.aten.embedding.default](args = (%weight, %indices, 3), ...)
_EMBEDDING_CALL = re.compile(r"aten\.embedding\.default\]\(args = \(%[^,()]+, %[^,()]+, (-?\d+)")


def exported_padding_index(node: onnx.NodeProto) -> int | None:
    """The padding index the dynamo exporter's metadata gives a lookup node, or None."""
    found = _EMBEDDING_CALL.search(fx_node_text(node))
    return int(found.group(1)) if found and int(found.group(1)) >= 0 else None


def _lookups(graph: onnx.GraphProto):
    """(node, weight) of each Gather on axis 0 of a float initializer."""
    floats = {t.name: t for t in graph.initializer if t.data_type in FLOAT_TYPES}
    for node in graph.node:
        if node.op_type != "Gather" or normalize_domain(node.domain) != STANDARD_DOMAIN:
            continue
        if attribute_or_default(node, "axis") == 0 and node.input[0] in floats:
            yield node, floats[node.input[0]]


def padding_rows(model: onnx.ModelProto, padding_idx: int | None = None) -> dict[str, int]:
    """Embedding weight -> its padding row: ``padding_idx`` for the lookups of token ids
    (indices that are a graph input, or a Cast of one), else what the export says."""
    graph = model.graph
    initializers = {t.name for t in graph.initializer}
    data_inputs = {i.name for i in graph.input if i.name not in initializers}
    casts = {n.output[0]: n.input[0] for n in graph.node if n.op_type == "Cast"}
    rows: dict[str, int] = {}
    for node, weight in _lookups(graph):
        if padding_idx is not None:
            indices = node.input[1]
            if casts.get(indices, indices) in data_inputs:
                rows[weight.name] = padding_idx
        else:
            found = exported_padding_index(node)
            if found is not None:
                rows[weight.name] = found
    if padding_idx is not None and not rows:
        raise GraphoptError(f"--padding-idx {padding_idx}: the model has no embedding lookup "
                            "of token ids (a Gather on axis 0 of a weight, indexed by a graph "
                            "input)")
    for name, row in rows.items():
        size = next(t.dims[0] for t in graph.initializer if t.name == name)
        if not 0 <= row < size:
            raise GraphoptError(f"padding index {row}: embedding {name!r} has {size} rows "
                                f"(0 to {size - 1})")
    return rows

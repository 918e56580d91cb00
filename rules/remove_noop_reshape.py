"""A Reshape whose target is its input's own shape, entry by entry -> removed (its readers
read the input).

Falcon's attention views tensors that already have the shape asked for: the key and value
of a multi-query layer are ``reshape(b, 1, s, d)`` of a ``[b, 1, s, d]`` Transpose, the
query ``reshape(b, heads, s, d)`` of a ``[b, heads, s, d]`` one. Each target entry must be
the input's dimension at that position: a 0 that copies it (``allowzero=0``), the same
known size, or a computed size with the same origin (rules/_dims.py); and the ranks must
agree. A -1 entry is left alone (it is the element count's to decide, and a 0-sized
dimension elsewhere makes it an error), as is a Reshape whose output is a graph output or
is read by a subgraph by name (the name must stay).
"""
from __future__ import annotations

from graphopt.dsl import Pass
from graphopt.vocabulary import attribute_default

from ._dims import DimOrigins


def _is_noop(graph, origins: DimOrigins, node_id: int) -> bool:
    source, target = graph.inputs_of(node_id)[:2]
    entries = origins.entries(target)
    if entries is None or origins.rank(source) != len(entries):
        return False
    allowzero = graph.attr(node_id, "allowzero", attribute_default("Reshape", "allowzero"))
    for axis, entry in enumerate(entries):
        if entry == 0 and not allowzero:
            continue  # copies the dimension
        if isinstance(entry, int) and entry < 0:
            return False
        if entry != origins.dim(source, axis):
            return False
    return True


def remove(graph, report) -> int:
    origins = DimOrigins(graph)
    removed = 0
    for node_id in sorted(graph.nodes_of_type("Reshape"), key=graph.order_of):
        inputs, outputs = graph.inputs_of(node_id), graph.outputs_of(node_id)
        if len(inputs) < 2 or graph.is_output(outputs[0]) \
                or graph.read_by_subgraph(outputs[0]) or not _is_noop(graph, origins, node_id):
            continue
        graph.remove_node(node_id)
        graph.redirect_readers(outputs[0], inputs[0])
        graph.remove_dead(inputs)
        removed += 1
    return removed


PASS = Pass(
    name="remove_noop_reshape",
    description="Reshape to its input's own shape (entry by entry) -> removed",
    level=1,
    tags=("cleanup",),
    run=remove,
)

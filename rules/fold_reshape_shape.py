"""``Reshape(x, Concat(...))`` whose target entries are each a constant or x's own dimension
at the same position -> ``Reshape(x, constant)``, the copied dimensions written as 0, as
ONNX Runtime's ReshapeFusion does.

TorchScript writes ``qkv.view(b, s, heads + 2, d)`` as a Concat of two
``Unsqueeze(Gather(Shape(qkv), i))`` and two constants; it becomes
``Reshape(qkv, [0, 0, heads + 2, d])`` and the shape nodes go. ONNX Runtime takes only
entries read off the Reshape's own input; here an entry counts as x's dimension i when it has
the same origin (rules/_dims.py: ``Shape(input_ids)[0]`` is the batch axis of every tensor
computed from input_ids), and an entry whose size is known is written as that number (the 64
of ``view(b, s, 64)`` after a contrib op that hid it from ONNX inference). With
``allowzero=1`` a 0 is a size, not a copy: only known sizes are written then. At most one
entry may be -1, as in any Reshape.
"""
from __future__ import annotations

import numpy as np
from onnx import numpy_helper

from graphopt.dsl import Pass
from graphopt.vocabulary import attribute_default

from ._dims import DimOrigins


def _constant_target(graph, origins: DimOrigins, node_id: int) -> np.ndarray | None:
    """The target as constants (x's own dims as 0), or None if an entry is neither."""
    source, target = graph.inputs_of(node_id)[:2]
    entries = origins.entries(target)
    if entries is None or graph.constant_value(target, 64) is not None:
        return None  # unknown, or a constant already
    allowzero = graph.attr(node_id, "allowzero", attribute_default("Reshape", "allowzero"))
    rank = origins.rank(source)
    values = []
    for axis, entry in enumerate(entries):
        if isinstance(entry, int):
            values.append(entry)
        elif not allowzero and rank is not None and axis < rank \
                and entry == origins.dim(source, axis):
            values.append(0)  # copies x's dim
        else:
            return None
    if sum(1 for v in values if v == -1) > 1:
        return None
    return np.array(values, np.int64)


def fold(graph, report) -> int:
    origins = DimOrigins(graph)
    changed = 0
    for node_id in sorted(graph.nodes_of_type("Reshape"), key=graph.order_of):
        if len(graph.inputs_of(node_id)) < 2:
            continue
        target = _constant_target(graph, origins, node_id)
        if target is None:
            continue
        old = graph.inputs_of(node_id)[1]
        name = graph.model.names.fresh(f"{graph.name_of(node_id) or 'reshape'}/shape")
        graph.add_initializer(numpy_helper.from_array(target, name))
        graph.replace_input(node_id, 1, name)
        graph.remove_dead([old])
        changed += 1
    return changed


PASS = Pass(
    name="fold_reshape_shape",
    description="Reshape(x, computed shape) -> Reshape(x, constant) when each entry is a "
                "constant or x's own dim there (0)",
    level=1,
    tags=("cleanup",),
    run=fold,
)

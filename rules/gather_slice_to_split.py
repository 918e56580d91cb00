"""Gathers and Slices that together tile one axis of a tensor -> one Split (+ Squeeze for a
scalar-index Gather). Falcon's fused_qkv[..., :-2, :], [..., [-2], :], [..., [-1], :]."""
from __future__ import annotations

import numpy as np

from graphopt.dsl import Rule, constant, fan_out, op, var
from graphopt.vocabulary import attribute_default

INDEX_TYPES = (np.int64, np.int32)

x = var("x")


def _one_index(value) -> int | None:
    if value is None or value.size != 1 or value.dtype.type not in INDEX_TYPES:
        return None
    return int(value.reshape(()))


def _gather_piece(node, dim: int):
    """(axis, start, end, squeeze) of a Gather, or a reason it cannot be a Split piece."""
    indices = node.input(1)
    value = indices.value if indices is not None else None
    index = _one_index(value)
    if index is None:
        return f"Gather '{node.name}' index is not a constant one-element int tensor"
    if value.ndim > 1:  # a [1, 1] index adds a dimension that no Split piece has
        return f"Gather '{node.name}' index has shape {list(value.shape)}, not scalar or [1]"
    index += dim if index < 0 else 0
    if not 0 <= index < dim:
        return f"Gather '{node.name}' index {index} is out of range for size {dim}"
    return index, index + 1, value.ndim == 0


def _slice_piece(node, dim: int):
    values = []
    for position, what in ((1, "starts"), (2, "ends"), (3, "axes"), (4, "steps")):
        tensor = node.input(position)
        if tensor is None:
            values.append(None)
            continue
        value = _one_index(tensor.value)
        if value is None:
            return f"Slice '{node.name}' {what} is not a constant one-element int tensor"
        values.append(value)
    start, end, _, step = values
    if step not in (None, 1):
        return f"Slice '{node.name}' has step {step}, not 1"
    start = min(max(start + dim if start < 0 else start, 0), dim)
    end = min(max(end + dim if end < 0 else end, 0), dim)
    if start >= end:
        return f"Slice '{node.name}' is empty ({start}:{end})"
    return start, end, False


def split_pieces(m):
    """The consumers' pieces on one axis, in axis order, if they tile it; else a reason."""
    shape = m.x.shape
    if shape is None:
        return f"rank of '{m.x.name}' is unknown"
    rank = len(shape)

    def axis_of(axis):
        axis = axis + rank if axis < 0 else axis
        return axis if 0 <= axis < rank else None

    by_axis: dict[int, list] = {}
    for node in m.consumers:
        if node.op_type == "Gather":
            axis = axis_of(node.attr("axis", attribute_default("Gather", "axis")))
        else:
            axes = node.input(3)
            given = 0 if axes is None else _one_index(axes.value)
            axis = None if given is None else axis_of(given)
        if axis is None:
            return f"{node.op_type} '{node.name}' axis is not a constant in range"
        by_axis.setdefault(axis, []).append(node)
    reasons = []
    for axis, nodes in by_axis.items():
        if len(nodes) < 2:
            continue
        dim = shape[axis]
        if dim is None:
            reasons.append(f"size of axis {axis} of '{m.x.name}' is not static")
            continue
        pieces = []
        for node in nodes:
            piece = (_gather_piece(node, dim) if node.op_type == "Gather"
                     else _slice_piece(node, dim))
            if isinstance(piece, str):
                reasons.append(piece)
                break
            pieces.append((piece[0], piece[1], piece[2], node))
        else:
            pieces.sort(key=lambda p: p[0])
            covered = 0
            for start, end, _, node in pieces:
                if start != covered:
                    kind = "overlap" if start < covered else "gap"
                    reasons.append(f"pieces on axis {axis} do not tile it: {kind} at {start} "
                                   f"({node.op_type} '{node.name}')")
                    break
                covered = end
            else:
                if covered == dim:
                    return axis, pieces
                reasons.append(f"pieces on axis {axis} stop at {covered}, size is {dim}")
    return "; ".join(reasons) or "no two Gather/Slice consumers share an axis"


def _not_shape_output(m):
    producer = m.x.producer
    if producer is not None and producer.op_type == "Shape":
        return "the tensor is the output of a Shape node"
    return True


def to_split(m):
    found = split_pieces(m)
    if isinstance(found, str):
        return found
    axis, pieces = found
    sizes = np.array([end - start for start, end, _, _ in pieces], dtype=np.int64)
    # Opsets 11 and 12 (still many exporters' default) take sizes and axes as attributes.
    as_attributes = (m.graph.model.opset("") or 0) < 13
    if as_attributes:
        outputs = op.Split(m.x, axis=axis, split=sizes.tolist(), _outputs=len(pieces))
    else:
        outputs = op.Split(m.x, constant(sizes, "split_sizes"), axis=axis, _outputs=len(pieces))
    result = {}
    for piece_output, (_, _, squeeze, node) in zip(outputs, pieces, strict=True):
        if squeeze and as_attributes:
            piece_output = op.Squeeze(piece_output, axes=[axis])
        elif squeeze:
            piece_output = op.Squeeze(piece_output,
                                      constant(np.array([axis], np.int64), "squeeze_axes"))
        result[node.output(0).name] = piece_output
    return result


RULE = Rule(
    name="gather_slice_to_split",
    description="Gather/Slice consumers tiling one axis -> one Split (Falcon MQA q, k, v)",
    level=1,
    tags=("fusion", "mqa"),
    min_opset={"": 11},
    match=fan_out(x, consumers=("Gather", "Slice"), input_index=0, min_consumers=2),
    where=[_not_shape_output],
    rewrite=to_split,
)

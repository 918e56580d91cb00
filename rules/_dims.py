"""Where a dimension comes from: which earlier tensor's dimension it provably equals, or its
number, from the semantics of the ops between them (shared by shape_dims_from_source and
fold_reshape_shape).

Exporters compute the batch and sequence sizes anew at every layer, ``Shape(h)[0]`` of
whatever tensor is at hand; ONNX Runtime and onnxscript can only merge two of them when they
read the same tensor (or, in onnxscript's case, when ONNX inference gave both the same symbol).
Here each dimension is followed up through the ops that carry it unchanged (elementwise
ops, MatMul's batch and row axes, Transpose, Gather, Split, Slice off its axes, Unsqueeze,
Squeeze, Concat off its axis, Reshape where the target shape copies it, ConstantOfShape of a
Shape, ...) to the first tensor it is read off. Two dimensions with the same origin are equal
whatever the inputs, so ``Shape(h)[0]`` at every layer becomes one ``Shape(input_ids)[0]``.

Every step is exact, never a guess from a symbol's name: a broadcast dimension is followed
only when the other operands' dimensions are 1 or share its origin; a Reshape's target entry
counts only when it cannot be a 0 that copies some other dimension (``allowzero=0``: a
computed entry that happens to be 0 copies the input's dimension instead). Walks stop at
MAX_DEPTH ops (the dimension is then its own origin: less is merged, nothing is wrong)."""
from __future__ import annotations

import numpy as np
import onnx

from graphopt.ir import STANDARD_DOMAIN, TYPE_OF_INPUT
from graphopt.vocabulary import MS_DOMAIN, attribute_default

from ._fused_matmul import flags_permutation

MAX_DEPTH = 200
# Output 0 has the shape of input 0 (the other outputs, if any, do not)
SAME_SHAPE = frozenset({
    "Abs", "Acos", "Acosh", "Asin", "Asinh", "Atan", "Atanh", "BatchNormalization",
    "BitwiseNot", "Cast", "CastLike", "Ceil", "Celu", "Clip", "Cos", "Cosh", "CumSum",
    "Dropout", "Elu", "Erf", "Exp", "Floor", "Gelu", "GroupNormalization", "HardSigmoid",
    "HardSwish", "Hardmax", "Identity", "InstanceNormalization", "IsInf", "IsNaN",
    "LayerNormalization", "LeakyRelu", "Log", "LogSoftmax", "LpNormalization",
    "MeanVarianceNormalization", "Mish", "Neg", "Not", "Reciprocal", "Relu", "Round", "Selu",
    "Shrink", "Sigmoid", "Sign", "Sin", "Sinh", "Softmax", "Softplus", "Softsign", "Sqrt",
    "Tan", "Tanh", "ThresholdedRelu", "Trilu"})
# Multidirectional (NumPy) broadcasting of all inputs
BROADCAST = frozenset({
    "Add", "And", "BitShift", "BitwiseAnd", "BitwiseOr", "BitwiseXor", "Div", "Equal",
    "Greater", "GreaterOrEqual", "Less", "LessOrEqual", "Max", "Mean", "Min", "Mod", "Mul",
    "Or", "PRelu", "Pow", "Sub", "Sum", "Where", "Xor"})


class DimOrigins:
    """Origins of the dimensions of one graph's tensors, memoized for one pass run (an origin
    stays true while the graph changes around it: rewrites replace values by equal ones).

    ``dim(t, axis)``: an int when the dimension's size is known, else ``(tensor, axis)``, the
    earliest dimension found equal to it (``(t, axis)`` itself when none is), or None when
    t's rank is unknown. ``element(t, j)``: the same for entry j of a 1-D int64 tensor (a
    shape being computed), None when unknown."""

    def __init__(self, graph):
        self.graph = graph
        self._dims: dict = {}
        self._elements: dict = {}
        self._shapes: dict = {}
        self._depth = 0

    # ---- small helpers ---------------------------------------------------------------
    def shape(self, tensor: str) -> list | None:
        """The tensor's static shape (asked often: kept for the run)."""
        if tensor not in self._shapes:
            self._shapes[tensor] = self.graph.static_shape(tensor)
        return self._shapes[tensor]

    def rank(self, tensor: str) -> int | None:
        shape = self.shape(tensor)
        return None if shape is None else len(shape)

    def _int_const(self, tensor: str) -> np.ndarray | None:
        if not tensor:
            return None
        value = self.graph.constant_value(tensor, 64)
        if value is None or value.dtype.kind not in "iu":
            return None
        return value.astype(np.int64)

    def _axes(self, node_id: int, index: int, attr: str = "axes") -> list[int] | None:
        """An axes input (opset 13+) or attribute (before), as a list; None if computed."""
        inputs = self.graph.inputs_of(node_id)
        if len(inputs) > index and inputs[index]:
            value = self._int_const(inputs[index])
            return None if value is None else [int(v) for v in value.reshape(-1)]
        axes = self.graph.attr(node_id, attr)
        return None if axes is None else list(axes)

    # ---- dimensions ------------------------------------------------------------------
    def dim(self, tensor: str, axis: int):
        rank = self.rank(tensor)
        if rank is None or not -rank <= axis < rank:
            return None
        axis %= rank
        key = (tensor, axis)
        if key in self._dims:
            return self._dims[key]
        static = self.shape(tensor)[axis]
        if static is not None:
            found = int(static)
        elif self._depth >= MAX_DEPTH:
            return key  # not memoized: a shallower walk may get further
        else:
            self._depth += 1
            try:
                found = self._traced(tensor, axis, rank)
            finally:
                self._depth -= 1
            if found is None:
                found = key
        self._dims[key] = found
        return found

    def _traced(self, tensor: str, axis: int, rank: int):
        graph = self.graph
        node_id = graph.producer_of(tensor)
        if node_id is None:
            return None
        domain, op_type = graph.op_key(node_id)
        inputs, outputs = graph.inputs_of(node_id), graph.outputs_of(node_id)
        index = outputs.index(tensor)
        if domain == MS_DOMAIN:
            if op_type == "FusedMatMul":
                return _fused_matmul(self, node_id, inputs, index, axis, rank)
            source = TYPE_OF_INPUT.get(op_type)
            if source is not None and len(inputs) > source and inputs[source]:
                return self._same(inputs[source], axis, rank)
            return None
        if domain != STANDARD_DOMAIN:
            return None
        if op_type in SAME_SHAPE:
            return self._same(inputs[0], axis, rank) if index == 0 else None
        if op_type in BROADCAST:
            return self.broadcast([n for n in inputs if n], axis, rank)
        handler = _HANDLERS.get(op_type)
        return None if handler is None else handler(self, node_id, inputs, index, axis, rank)

    def _same(self, source: str, axis: int, rank: int):
        return self.dim(source, axis) if self.rank(source) == rank else None

    def broadcast(self, operands, axis: int, rank: int):
        """Axis ``axis`` of the broadcast of ``operands`` (output rank ``rank``)."""
        found = []
        for name in operands:
            r = self.rank(name)
            if r is None:
                return None
            position = axis - (rank - r)
            if position >= 0:  # (an operand with fewer dims is broadcast as 1 there)
                found.append(self.dim(name, position))
        return _broadcast_sizes(found)

    # ---- entries of shape tensors ------------------------------------------------------
    def element(self, tensor: str, j: int):
        """Entry j of the 1-D tensor ``tensor``: an int, a dimension's origin, or None."""
        key = (tensor, j)
        if key in self._elements:
            return self._elements[key]
        if self._depth >= MAX_DEPTH:
            return None
        self._depth += 1
        try:
            found = self._element(tensor, j)
        finally:
            self._depth -= 1
        self._elements[key] = found
        return found

    def _element(self, tensor: str, j: int):
        graph = self.graph
        value = self._int_const(tensor)
        if value is not None:
            flat = value.reshape(-1)
            return int(flat[j]) if value.ndim <= 1 and -len(flat) <= j < len(flat) else None
        node_id = graph.producer_of(tensor)
        if node_id is None or graph.op_key(node_id)[0] != STANDARD_DOMAIN:
            return None
        op_type, inputs = graph.op_key(node_id)[1], graph.inputs_of(node_id)
        if op_type == "Shape":
            rank = self.rank(inputs[0])
            if rank is None:
                return None
            start = graph.attr(node_id, "start", attribute_default("Shape", "start"))
            end = graph.attr(node_id, "end", rank)
            positions = list(range(rank))[start:end]
            return self.dim(inputs[0], positions[j]) if 0 <= j < len(positions) else None
        if op_type == "Concat":
            offset = 0
            for part in inputs:
                shape = self.shape(part)
                if shape is None or len(shape) != 1 or shape[0] is None:
                    return None
                if j < offset + shape[0]:
                    return self.element(part, j - offset)
                offset += shape[0]
            return None
        if op_type == "Unsqueeze":  # a scalar made 1-D: its one entry
            return self.scalar(inputs[0]) if j == 0 and self.rank(inputs[0]) == 0 else None
        if op_type == "Cast" and self._is_int64(tensor) and self._is_int64(inputs[0]):
            return self.element(inputs[0], j)
        if op_type == "Gather":
            return self._gathered(node_id, inputs, j)
        return None

    def scalar(self, tensor: str):
        """The value of a 0-D int tensor (a dimension read off a shape), as element()."""
        value = self._int_const(tensor)
        if value is not None:
            return int(value.reshape(())) if value.size == 1 else None
        graph = self.graph
        node_id = graph.producer_of(tensor)
        if node_id is None or graph.op_key(node_id)[0] != STANDARD_DOMAIN:
            return None
        op_type, inputs = graph.op_key(node_id)[1], graph.inputs_of(node_id)
        if op_type == "Gather":
            return self._gathered(node_id, inputs, 0)
        if op_type == "Squeeze" and self.rank(inputs[0]) == 1:
            return self.element(inputs[0], 0)
        if op_type == "Cast" and self._is_int64(tensor) and self._is_int64(inputs[0]):
            return self.scalar(inputs[0])
        return None

    def _gathered(self, node_id: int, inputs, j: int):
        """Entry j (of the flattened result) of Gather(data, constant indices), data 1-D."""
        indices = self._int_const(inputs[1]) if len(inputs) > 1 else None
        if indices is None or self.rank(inputs[0]) != 1:
            return None
        flat = indices.reshape(-1)
        if not 0 <= j < len(flat):
            return None
        length = self.shape(inputs[0])[0]
        position = int(flat[j])
        if position < 0:
            if length is None:
                return None
            position += length
        return self.element(inputs[0], position)

    def entries(self, tensor: str) -> list | None:
        """Every entry of the 1-D tensor ``tensor`` (a Reshape's target), None if one is
        unknown or its length is."""
        shape = self.shape(tensor) if tensor else None
        if shape is None or len(shape) != 1 or shape[0] is None:
            return None
        found = [self.element(tensor, j) for j in range(shape[0])]
        return None if any(e is None for e in found) else found

    def _is_int64(self, tensor: str) -> bool:
        return self.graph.elem_type(tensor) == onnx.TensorProto.INT64


# ---- the ops that move dimensions around (output axis -> an input's) ---------------------
def _matmul(origins, node_id, inputs, index, axis, rank, flags=((), ())):
    """MatMul, and FusedMatMul with ``flags``: each operand's permutation (its transBatch
    and trans flags applied), () for none."""
    ra, rb = origins.rank(inputs[0]), origins.rank(inputs[1])
    if ra is None or rb is None or ra < 2 or rb < 2:
        return None  # 1-D operands are promoted and their axis dropped: not followed
    perm_a, perm_b = flags[0] or range(ra), flags[1] or range(rb)

    def a(i):
        return origins.dim(inputs[0], perm_a[i])

    def b(i):
        return origins.dim(inputs[1], perm_b[i])
    if axis == rank - 1:
        return b(rb - 1)
    if axis == rank - 2:
        return a(ra - 2)
    batch = []  # the batch axes broadcast; the matrix axes are not part of it
    for read, r in ((a, ra), (b, rb)):
        position = axis - (rank - r)
        if position >= 0:
            batch.append(read(position))
    return _broadcast_sizes(batch)


def _fused_matmul(origins, node_id, inputs, index, axis, rank):
    graph = origins.graph
    flags = []
    for i, side in enumerate("AB"):
        r = origins.rank(inputs[i]) if len(inputs) > i else None
        if r is None:
            return None
        trans, batch = f"trans{side}", f"transBatch{side}"
        flags.append(flags_permutation(
            r, bool(graph.attr(node_id, trans, attribute_default("FusedMatMul", trans, MS_DOMAIN))),
            bool(graph.attr(node_id, batch, attribute_default("FusedMatMul", batch, MS_DOMAIN)))))
    return _matmul(origins, node_id, inputs, index, axis, rank, tuple(flags))


def _broadcast_sizes(found):
    """The broadcast of dims (int or origin each, None unknown), by its rule: a size other
    than 1 is the result (a valid model has every other one 1 or equal to it); sizes of 1
    drop out; the origins left must all be the same one."""
    origins = []
    for d in found:
        if d is None:
            return None
        if isinstance(d, int):
            if d != 1:
                return d
            continue
        origins.append(d)
    if not origins:
        return 1
    return origins[0] if all(o == origins[0] for o in origins) else None


def _gemm(origins, node_id, inputs, index, axis, rank):
    graph = origins.graph
    if axis == 0:
        trans = graph.attr(node_id, "transA", attribute_default("Gemm", "transA"))
        return origins.dim(inputs[0], 1 if trans else 0)
    trans = graph.attr(node_id, "transB", attribute_default("Gemm", "transB"))
    return origins.dim(inputs[1], 0 if trans else 1)


def _transpose(origins, node_id, inputs, index, axis, rank):
    perm = origins.graph.attr(node_id, "perm")
    perm = list(range(rank))[::-1] if perm is None else list(perm)
    return origins.dim(inputs[0], perm[axis]) if len(perm) == rank else None


def _gather(origins, node_id, inputs, index, axis, rank):
    r, q = origins.rank(inputs[0]), origins.rank(inputs[1])
    if r is None or q is None:
        return None
    gather_axis = origins.graph.attr(node_id, "axis", attribute_default("Gather", "axis")) % r
    if axis < gather_axis:
        return origins.dim(inputs[0], axis)
    if axis < gather_axis + q:
        return origins.dim(inputs[1], axis - gather_axis)
    return origins.dim(inputs[0], axis - q + 1)


def _split(origins, node_id, inputs, index, axis, rank):
    split_axis = origins.graph.attr(node_id, "axis", attribute_default("Split", "axis")) % rank
    if axis != split_axis:
        return origins._same(inputs[0], axis, rank)
    return None  # the piece's own size: static_shape has it when it is known


def _concat(origins, node_id, inputs, index, axis, rank):
    concat_axis = origins.graph.attr(node_id, "axis") % rank
    if axis == concat_axis:
        return None
    # every input has the output's size there: the first one's origin will do, all agreeing
    # is not needed (a valid model has them equal)
    return origins._same(inputs[0], axis, rank)


def _slice(origins, node_id, inputs, index, axis, rank):
    if len(inputs) == 1:  # before opset 10: starts, ends and axes are attributes
        axes = origins.graph.attr(node_id, "axes")
        if axes is None:
            starts = origins.graph.attr(node_id, "starts")
            axes = None if starts is None else range(len(starts))
        if axes is None:
            return None
        axes = [int(a) % rank for a in axes]
    elif len(inputs) > 3 and inputs[3]:
        axes = origins._int_const(inputs[3])
        if axes is None:
            return None
        axes = [int(a) % rank for a in axes.reshape(-1)]
    else:
        starts = origins.graph.static_shape(inputs[1])
        if starts is None or len(starts) != 1 or starts[0] is None:
            return None
        axes = list(range(starts[0]))
    if axis in axes:
        return None
    return origins._same(inputs[0], axis, rank)


def _unsqueeze(origins, node_id, inputs, index, axis, rank):
    axes = origins._axes(node_id, 1)
    if axes is None:
        return None
    axes = {a % rank for a in axes}
    if axis in axes:
        return 1
    return origins.dim(inputs[0], axis - sum(1 for a in axes if a < axis))


def _squeeze(origins, node_id, inputs, index, axis, rank):
    r = origins.rank(inputs[0])
    axes = origins._axes(node_id, 1)
    if r is None or axes is None or not axes:
        return None  # no axes: every dim of size 1 goes, which ones is not known here
    removed = {a % r for a in axes}
    kept = [i for i in range(r) if i not in removed]
    return origins.dim(inputs[0], kept[axis]) if axis < len(kept) else None


def _reshape(origins, node_id, inputs, index, axis, rank):
    entry = origins.element(inputs[1], axis)
    allowzero = origins.graph.attr(node_id, "allowzero", attribute_default("Reshape", "allowzero"))
    source_rank = origins.rank(inputs[0])
    if source_rank is None:
        return None
    copies = origins.dim(inputs[0], axis) if axis < source_rank else None
    if isinstance(entry, int):
        if entry > 0:
            return entry
        if entry == 0:
            return entry if allowzero else copies
        return None  # -1: inferred from the others
    if entry is None:
        return None
    # A computed entry is the size it names, unless it is 0 (allowzero=0) and copies the
    # input's dim there instead: the same when both have the same origin, and never so
    # past the input's rank (there a 0 is an error, the node runs only if it is not 0).
    if allowzero or axis >= source_rank or entry == copies:
        return entry
    return None


def _expand(origins, node_id, inputs, index, axis, rank):
    target = origins.graph.static_shape(inputs[1])
    r = origins.rank(inputs[0])
    if target is None or len(target) != 1 or target[0] is None or r is None:
        return None
    found = []
    position = axis - (rank - r)
    if position >= 0:
        found.append(origins.dim(inputs[0], position))
    position = axis - (rank - target[0])
    if position >= 0:
        found.append(origins.element(inputs[1], position))
    if any(f is None for f in found):
        return None
    sizes = [f for f in found if not isinstance(f, int) or f != 1]
    if not sizes:
        return 1
    static = [f for f in sizes if isinstance(f, int)]
    if static:
        return static[0]
    return sizes[0] if all(s == sizes[0] for s in sizes) else None


def _range(origins, node_id, inputs, index, axis, rank):
    """Range(0, n, 1) has n elements (n, a dimension read off a shape, is never negative)."""
    start, delta = origins._int_const(inputs[0]), origins._int_const(inputs[2])
    if start is None or delta is None or start.size != 1 or delta.size != 1 \
            or int(start.reshape(())) != 0 or int(delta.reshape(())) != 1:
        return None
    limit = origins.scalar(inputs[1])
    return max(limit, 0) if isinstance(limit, int) else limit


def _constant_of_shape(origins, node_id, inputs, index, axis, rank):
    return origins.element(inputs[0], axis)


_HANDLERS = {"MatMul": _matmul, "Gemm": _gemm, "Transpose": _transpose, "Gather": _gather,
             "Split": _split, "Concat": _concat, "Slice": _slice, "Unsqueeze": _unsqueeze,
             "Squeeze": _squeeze, "Reshape": _reshape, "Expand": _expand,
             "ConstantOfShape": _constant_of_shape, "Range": _range}

"""Gradients of ops that move data without computing on it: the gradient moves back."""
from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

from ..registry import GradientContext, gradient


@gradient("Identity")
def identity(ctx: GradientContext):
    return [ctx.dy]


@gradient("Cast")
def cast(ctx: GradientContext):
    x = ctx.input(0)
    return [ctx.op("Cast", ctx.dy, to=ctx.dtype(x)) if ctx.is_float(x) else None]


@gradient("Reshape", "Flatten", "Squeeze", "Unsqueeze")
def reshape(ctx: GradientContext):
    """Same elements, other shape: reshape the gradient back to the input's shape."""
    return [ctx.reshape_like(ctx.dy, ctx.input(0))]


@gradient("Transpose")
def transpose(ctx: GradientContext):
    perm = ctx.attr("perm")
    if perm is None:  # the default reverses the dims, its own inverse
        return [ctx.op("Transpose", ctx.dy)]
    inverse = [0] * len(perm)
    for position, axis in enumerate(perm):
        inverse[axis] = position
    return [ctx.op("Transpose", ctx.dy, perm=inverse)]


@gradient("Expand")
def expand(ctx: GradientContext):
    return [ctx.sum_to(ctx.dy, ctx.input(0), ctx.shape(ctx.output(0)))]


@gradient("Where")
def where(ctx: GradientContext):
    """Each branch gets the gradient where it was chosen, zero elsewhere."""
    condition, y = ctx.input(0), ctx.output(0)
    zero = ctx.scalar(0.0, y)
    grads = [None, None, None]
    if ctx.needs(1):
        grads[1] = ctx.sum_to(ctx.op("Where", condition, ctx.dy, zero), ctx.input(1), ctx.shape(y))
    if ctx.needs(2):
        grads[2] = ctx.sum_to(ctx.op("Where", condition, zero, ctx.dy), ctx.input(2), ctx.shape(y))
    return grads


@gradient("Dropout")
def dropout(ctx: GradientContext):
    """ONNX Runtime's DropoutGrad with the forward mask; ratio and mode as the forward node
    has them (an inference-mode Dropout passes the gradient through unchanged)."""
    mask = ctx.forward_output(1, "mask")
    if ctx.opset >= 12:
        ratio, training_mode = ctx.input(1) or None, ctx.input(2) or None
    else:  # ratio was an attribute and there was no mode input
        ratio, training_mode = ctx.const(np.array(ctx.attr_or_default("ratio"), np.float32)), None
    return [ctx.ms("DropoutGrad", ctx.dy, mask, ratio, training_mode)]


# ---- splitting and joining -------------------------------------------------------------------
def _axis(ctx: GradientContext, tensor: str, default: int = 0) -> int:
    axis = ctx.attr("axis", default)
    return axis + ctx.rank(tensor) if axis < 0 else axis


@gradient("Split")
def split(ctx: GradientContext):
    """Concat of the pieces' gradients; a piece nobody used contributes zeros."""
    pieces = [ctx.output_grad(i) or ctx.zeros_like(out) for i, out in enumerate(ctx.node.output)]
    return [ctx.op("Concat", *pieces, axis=ctx.attr_or_default("axis"))]


@gradient("Concat")
def concat(ctx: GradientContext):
    """Split the gradient at the inputs' sizes along the axis."""
    inputs = list(ctx.node.input)
    axis = _axis(ctx, inputs[0])
    shapes = [ctx.shape(x) for x in inputs]
    sizes = [s[axis] if s is not None else None for s in shapes]
    count = len(inputs)
    if all(isinstance(s, int) for s in sizes):
        if ctx.opset >= 13:
            pieces = ctx.op("Split", ctx.dy, ctx.ints(sizes), axis=axis, outputs=count)
        else:
            pieces = ctx.op("Split", ctx.dy, axis=axis, split=sizes, outputs=count)
    else:  # sizes known only at run time: read each input's extent along the axis
        extents = [ctx.op("Slice", ctx.op("Shape", x), ctx.ints([axis]), ctx.ints([axis + 1]))
                   for x in inputs]
        runtime_sizes = ctx.op("Concat", *extents, axis=0)
        if ctx.opset >= 13:
            pieces = ctx.op("Split", ctx.dy, runtime_sizes, axis=axis, outputs=count)
        else:  # Split took its sizes as an attribute before opset 13
            pieces = ctx.ms("SplitTraining", ctx.dy, runtime_sizes, axis=axis, outputs=count)
    pieces = [pieces] if count == 1 else pieces
    return [piece if ctx.needs(i) else None for i, piece in enumerate(pieces)]


# ---- indexing ------------------------------------------------------------------------------------
@gradient("Slice")
def slice_(ctx: GradientContext):
    """ONNX Runtime's SliceGrad: zeros of the input's shape with the gradient at the slice."""
    x = ctx.input(0)
    if ctx.opset >= 10:
        bounds = [ctx.input(i) or None for i in range(1, 5)]  # starts, ends, axes, steps
    else:  # starts/ends/axes were attributes
        axes = ctx.attr("axes")
        bounds = [ctx.ints(ctx.attr("starts")), ctx.ints(ctx.attr("ends")),
                  ctx.ints(axes) if axes is not None else None, None]
    while bounds and bounds[-1] is None:
        bounds.pop()
    return [ctx.ms("SliceGrad", ctx.dy, ctx.shape_of(x), *bounds)]


@gradient("Gather")
def gather(ctx: GradientContext):
    """ONNX Runtime's GatherGrad: scatter-add into zeros (an index may repeat). A lookup in
    an embedding with a padding row (ctx.padding_rows) sends nothing from the positions
    that read that row, as nn.Embedding(padding_idx) does."""
    x, indices = ctx.input(0), ctx.input(1)
    axis = ctx.attr_or_default("axis")
    dy = ctx.dy
    row = ctx.padding_rows.get(x)
    if row is not None and axis == 0:
        index_type = helper.tensor_dtype_to_np_dtype(ctx.dtype(indices) or TensorProto.INT64)
        counted = ctx.op("Not", ctx.op("Equal", indices, ctx.const(np.array(row, index_type))))
        index_rank = ctx.rank(indices)
        trailing = list(range(index_rank, index_rank + ctx.rank(x) - 1))
        keep = ctx.op("CastLike", counted, dy) if ctx.opset >= 15 else \
            ctx.op("Cast", counted, to=ctx.dtype(dy) or TensorProto.FLOAT)
        dy = ctx.op("Mul", dy, ctx.unsqueeze(keep, trailing) if trailing else keep)
    return [ctx.ms("GatherGrad", ctx.shape_of(x), indices, dy, axis=axis), None]


def _scatter_add_needs_opset_16(ctx: GradientContext) -> None:
    if ctx.opset < 16:  # the reduction attribute of ScatterElements/ScatterND
        raise ctx.fail("its gradient is a scatter-add, which needs opset >= 16 "
                       f"(the model has {ctx.opset})")


@gradient("GatherElements")
def gather_elements(ctx: GradientContext):
    _scatter_add_needs_opset_16(ctx)
    x, indices = ctx.input(0), ctx.input(1)
    return [ctx.op("ScatterElements", ctx.zeros_like(x), indices, ctx.dy,
                   axis=ctx.attr_or_default("axis"), reduction="add"), None]


@gradient("GatherND")
def gather_nd(ctx: GradientContext):
    """PyTorch's dynamo exporter writes ``t[..., [i], :]`` as GatherND."""
    if ctx.attr_or_default("batch_dims"):
        raise ctx.fail("GatherND with batch_dims > 0 has no gradient definition")
    _scatter_add_needs_opset_16(ctx)
    x, indices = ctx.input(0), ctx.input(1)
    return [ctx.op("ScatterND", ctx.zeros_like(x), indices, ctx.dy, reduction="add"), None]

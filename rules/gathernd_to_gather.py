"""GatherND(data, indices[..., 1]) with batch_dims 0 and constant indices -> Gather on axis 0
(how PyTorch's dynamo exporter writes fused_qkv[..., [-2], :] after moving the axis first)."""
import numpy as np

from graphopt.dsl import Rule, const, constant, op, var

data = var("data")


def _single_coordinate(value) -> bool:
    return value.ndim >= 1 and value.shape[-1] == 1 and value.dtype.type in (np.int64, np.int32)


def to_gather(m):
    indices = m.indices.value[..., 0].astype(np.int64)
    return op.Gather(m.data, constant(indices, "gather_indices"), axis=0)


RULE = Rule(
    name="gathernd_to_gather",
    description="GatherND with one-coordinate constant indices -> Gather(axis=0)",
    level=1,
    tags=("canonicalize", "mqa"),
    match=op.GatherND(data, const("indices", _single_coordinate,
                                  "indices are not constant ints with last dimension 1"),
                      batch_dims=lambda v: v in (None, 0)),
    rewrite=to_gather,
)

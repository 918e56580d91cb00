"""graphopt's built-in rules: one file per rule, each listed here (RULES), which is what the
registry reads. A new rule is a new file and a line in each list below."""
from graphopt.layout import refuse_second_name

refuse_second_name(__name__, "rules")

from . import (  # noqa: E402  (after the guard above)
    bias_gelu_fusion,
    constant_to_initializer,
    eliminate_common_subexpressions,
    fast_gelu_fusion,
    fold_constants,
    fold_reshape_shape,
    fold_reshapes,
    fold_shapes,
    fold_transposes,
    fold_unsqueezes,
    gather_slice_to_split,
    gathernd_to_gather,
    gelu_fusion,
    mark_backward_pass,
    matmul_scale_to_fused_matmul,
    matmul_transpose_to_fused_matmul,
    remove_identity,
    remove_noop_arithmetic,
    remove_noop_cast,
    remove_noop_reshape,
    shape_dims_from_source,
    shape_of_transpose,
    transpose_gather_to_gather_transpose,
    transposed_matmul_to_fused_matmul,
)

# in file-name order, the order the engine offers them in
RULES = [
    bias_gelu_fusion.RULE,
    constant_to_initializer.PASS,
    eliminate_common_subexpressions.PASS,
    fast_gelu_fusion.RULE,
    fold_constants.PASS,
    fold_reshape_shape.PASS,
    fold_reshapes.RULE,
    fold_shapes.PASS,
    fold_transposes.RULE,
    fold_unsqueezes.RULE,
    gather_slice_to_split.RULE,
    gathernd_to_gather.RULE,
    gelu_fusion.RULE,
    mark_backward_pass.PASS,
    matmul_scale_to_fused_matmul.RULE,
    matmul_transpose_to_fused_matmul.RULE,
    remove_identity.PASS,
    remove_noop_arithmetic.RULE,
    remove_noop_cast.RULE,
    remove_noop_reshape.PASS,
    shape_dims_from_source.PASS,
    shape_of_transpose.RULE,
    transpose_gather_to_gather_transpose.RULE,
    transposed_matmul_to_fused_matmul.RULE,
]

__all__ = ["RULES"]

"""Transpose swapping the last two dims of a MatMul/FusedMatMul's result -> one FusedMatMul
with its operands swapped: (op(A) op(B))^T = op(B)^T op(A)^T, so the product is written in
the transposed layout directly instead of being written and then copied with strided reads.

A training graph makes this pattern for a tied weight: the output projection reads the
embedding transposed, so the projection's weight gradient (X^T dY, [hidden, vocab]) is
transposed back and added to the embedding's gradient; after the rewrite the GEMM produces
dY^T X in the embedding's own layout."""
from graphopt.dsl import Rule, attr, check, is_float, one_of, op, single_consumer, var
from graphopt.vocabulary import MS_DOMAIN

from ._fused_matmul import fused_attrs

a, b = var("a"), var("b")


def _swaps_last_two(m) -> bool:
    """The Transpose exchanges the product's last two dims and nothing else. Without a perm
    ONNX reverses every dim: that is the swap for a product of rank 2 (a tied weight's
    gradient, transposed back by the Transpose that tied it)."""
    perm = m.get("perm")
    rank = max(len(m.a.shape), len(m.b.shape))  # both known: checked before
    if perm is None:
        perm = list(reversed(range(rank)))
    return rank >= 2 and list(perm) == [*range(rank - 2), rank - 1, rank - 2]


def _operands_are_matrices(m):
    """Both operands of known rank >= 2: a rank-1 operand's dim is dropped from the result,
    so the result's last two dims are not op(A)'s rows and op(B)'s columns."""
    ranks = [None if t.shape is None else len(t.shape) for t in (m.a, m.b)]
    if None in ranks:
        return "an operand's rank is unknown"
    if min(ranks) < 2:
        return "a rank-1 operand: the result's last two dims are not the product's"
    return True


def swap(m):
    attrs = fused_attrs(m.product)
    attrs["transA"], attrs["transB"] = 1 - attrs["transB"], 1 - attrs["transA"]
    return op.ms.FusedMatMul(m.b, m.a, **attrs)


RULE = Rule(
    name="transposed_matmul_to_fused_matmul",
    description="Transpose of the last two dims of a MatMul/FusedMatMul result -> FusedMatMul "
                "of the swapped operands, transA/transB exchanged and flipped",
    level=2,
    tags=("fusion", MS_DOMAIN),
    match=one_of(
        op.Transpose(op.MatMul(a, b, _name="product"), perm=attr("perm"), _name="base"),
        op.Transpose(op.ms.FusedMatMul(a, b, _name="product"), perm=attr("perm"),
                     _name="base"),
    ),
    where=[
        single_consumer("product", "the product is read by more than the Transpose"),
        check(lambda m: fused_attrs(m.product)["transBatchA"] == 0
              and fused_attrs(m.product)["transBatchB"] == 0,
              "transBatch flags: the swapped product would move batch dims"),
        _operands_are_matrices,
        check(_swaps_last_two, "the Transpose does not swap just the last two dims"),
        is_float("a", "b", reason="FusedMatMul needs float inputs"),
    ],
    rewrite=swap,
)

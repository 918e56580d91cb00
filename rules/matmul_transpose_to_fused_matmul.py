"""MatMul/FusedMatMul whose input is a Transpose FusedMatMul can express -> FusedMatMul with
transA/transB/transBatchA/transBatchB; the Transpose stays only if something else reads it."""
from graphopt.dsl import Rule, is_float, one_of, op, var

from ._fused_matmul import absorb_flags, fused_attrs

a, b = var("a"), var("b")


def _transposed(x, name):
    return op.Transpose(x, _name=name)


def _absorb(attrs, transpose, trans, batch):
    """Folds ``transpose`` into the flags ``attrs[trans]``, ``attrs[batch]``; a reason if
    FusedMatMul cannot express it."""
    perm = transpose.attr("perm")
    if perm is None:
        return "Transpose has no perm (reverses all dims; rank unknown)"
    flags = absorb_flags(tuple(perm), attrs[trans], attrs[batch])
    if flags is None:
        return f"Transpose perm {list(perm)} is not expressible by FusedMatMul flags"
    attrs[trans], attrs[batch] = flags
    return None


def fuse(m):
    attrs = fused_attrs(m.base)
    ta, tb = m.get("ta"), m.get("tb")
    if ta is not None:
        reason = _absorb(attrs, ta, "transA", "transBatchA")
        if reason is not None:
            return reason
    if tb is not None:
        reason = _absorb(attrs, tb, "transB", "transBatchB")
        if reason is not None:
            return reason
    if attrs["transBatchA"] or attrs["transBatchB"]:
        # onnxruntime's FusedMatMul kernel refuses transBatch unless both inputs have the
        # same rank >= 3 (matmul_helper.h: "Two inputs should have same rank and rank >= 3
        # if transBatchA or transBatchB is true"), so such a fusion would fail at run time.
        ranks = [None if t.shape is None else len(t.shape) for t in (m.a, m.b)]
        if None in ranks or ranks[0] != ranks[1] or ranks[0] < 3:
            shown = ", ".join("unknown" if r is None else str(r) for r in ranks)
            return (f"transBatch needs both inputs of the same rank >= 3 (ranks {shown}); "
                    "onnxruntime rejects anything else")
    if attrs["transA"] and ta is not None:
        # onnxruntime's CPU FusedMatMul computes wrong values for transA=1 with a rank-1 B
        # (found by tests/robustness: MatMul(Transpose(a), b[k]) came out different).
        # (An unknown rank is let through: after a YieldOp shapes are often unknown, and
        # backward-pass MatMuls have rank >= 2 operands.)
        b_shape = m.b.shape
        if b_shape is not None and len(b_shape) < 2:
            return "transA with a rank-1 B: onnxruntime's FusedMatMul gets it wrong"
    return op.ms.FusedMatMul(m.a, m.b, **attrs)


RULE = Rule(
    name="matmul_transpose_to_fused_matmul",
    description=__doc__.splitlines()[0],
    level=2,
    tags=("fusion", "com.microsoft"),
    match=one_of(
        op.MatMul(_transposed(a, "ta"), b, _name="base"),
        op.MatMul(a, _transposed(b, "tb"), _name="base"),
        op.ms.FusedMatMul(_transposed(a, "ta"), b, _name="base"),
        op.ms.FusedMatMul(a, _transposed(b, "tb"), _name="base"),
    ),
    where=[is_float("b", "a", reason="FusedMatMul needs float inputs")],
    rewrite=fuse,
)

"""MatMul/FusedMatMul whose input is a Transpose FusedMatMul can express -> FusedMatMul with
transA/transB/transBatchA/transBatchB; the Transpose stays only if something else reads it."""
from graphopt.dsl import Rule, attr, is_float, one_of, op, var
from graphopt.vocabulary import MS_DOMAIN

from ._fused_matmul import absorb_flags, fused_attrs

a, b = var("a"), var("b")
NO_PERM = ()  # a Transpose without perm reverses all dims


def _transposed(x, side):
    """A Transpose feeding input ``side`` (A or B); its perm is bound as perm_A / perm_B,
    the node as transpose_A / transpose_B."""
    return op.Transpose(x, perm=attr(f"perm_{side}", NO_PERM), _name=f"transpose_{side}")


def _absorb(attrs, perm, side):
    """Folds Transpose(perm) on input ``side`` into the flags trans<side> and
    transBatch<side>; a reason if FusedMatMul cannot express it."""
    if perm is NO_PERM:
        return "Transpose has no perm (reverses all dims; rank unknown)"
    trans, batch = f"trans{side}", f"transBatch{side}"
    flags = absorb_flags(tuple(perm), attrs[trans], attrs[batch])
    if flags is None:
        return f"Transpose perm {list(perm)} is not expressible by FusedMatMul flags"
    attrs[trans], attrs[batch] = flags
    return None


def _b_transpose(m):
    """(perm, input) of a Transpose producing B when the pattern matched only A's."""
    producer = m.b.producer
    if producer is None or producer.op_type != "Transpose" or producer.domain:
        return None, None
    perm = producer.attr("perm")
    return (NO_PERM if perm is None else tuple(perm)), producer.input(0)


def fuse(m):
    attrs = fused_attrs(m.base)
    perm_a, perm_b = m.get("perm_A"), m.get("perm_B")
    inputs = {"A": m.a, "B": m.b}
    if perm_a is not None:
        reason = _absorb(attrs, perm_a, "A")
        if reason is not None:
            # A Transpose FusedMatMul cannot express (attention's [0, 2, 1, 3] on q) stays and
            # is read as it is; B's own Transpose (k's last-two swap) may still be absorbed.
            perm_b, b_source = _b_transpose(m)
            if perm_b is None:
                return reason
            inputs["A"], inputs["B"] = m.transpose_A.output(0), b_source
            perm_a = None
    if perm_b is not None:
        reason = _absorb(attrs, perm_b, "B")
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
    if attrs["transA"] and perm_a is not None:
        # onnxruntime's CPU FusedMatMul computes wrong values for transA=1 with a rank-1 B
        # (found by tests/robustness: MatMul(Transpose(a), b[k]) came out different).
        # (An unknown rank is let through: after a YieldOp shapes are often unknown, and
        # backward-pass MatMuls have rank >= 2 operands.)
        b_shape = m.b.shape
        if b_shape is not None and len(b_shape) < 2:
            return "transA with a rank-1 B: onnxruntime's FusedMatMul gets it wrong"
    return op.ms.FusedMatMul(inputs["A"], inputs["B"], **attrs)


RULE = Rule(
    name="matmul_transpose_to_fused_matmul",
    description="MatMul/FusedMatMul reading a Transpose it can express -> FusedMatMul with "
                "transA/transB/transBatchA/transBatchB",
    level=2,
    tags=("fusion", MS_DOMAIN),
    match=one_of(
        op.MatMul(_transposed(a, "A"), b, _name="base"),
        op.MatMul(a, _transposed(b, "B"), _name="base"),
        op.ms.FusedMatMul(_transposed(a, "A"), b, _name="base"),
        op.ms.FusedMatMul(a, _transposed(b, "B"), _name="base"),
    ),
    where=[is_float("b", "a", reason="FusedMatMul needs float inputs")],
    rewrite=fuse,
)

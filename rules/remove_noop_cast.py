"""``Cast(x, to=T)`` where x already has element type T -> x, as ONNX Runtime's
CastElimination does (onnxscript's ``cast_identity`` too).

TorchScript writes a Cast for every ``.to(dtype)`` and ``.float()`` whatever the tensor's
type: Falcon's and GPT-2's attention cast the float32 softmax to float32, the rotary
embedding casts float32 cos and sin tables to float32, the position ids are cast from int64
to int64. Such a Cast copies its input and nothing else. The element type must be known
(from the graph's types or inference); a Cast whose output is a graph output becomes an
Identity that keeps the name (remove_identity then renames its producer where it can).
"""
from graphopt.dsl import Rule, attr, check, op, var

x = var("x")

RULE = Rule(
    name="remove_noop_cast",
    description="Cast to the element type its input already has -> removed",
    level=1,
    tags=("cleanup",),
    match=op.Cast(x, to=attr("to"), _name="cast"),
    where=[check(lambda m: m.x.elem_type is not None and m.x.elem_type == m.to,
                 "the input's element type is not the Cast's target (or is unknown)")],
    rewrite=lambda m: m.x,
)

"""fold_unsqueezes: Unsqueeze(Unsqueeze(x, a), b) -> one Unsqueeze with both sets of axes."""
from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import numpy_helper
from support.models import (
    assert_no_change,
    assert_same_outputs,
    assert_second_run_changes_nothing,
    model_from_text,
    op_types,
)

import graphopt

RULE = "fold_unsqueezes"


def chain(first: list[int], second: list[int], third: list[int] | None = None,
          opset: int = 17) -> onnx.ModelProto:
    axes = [first, second] + ([third] if third is not None else [])
    rank = 2 + sum(len(a) for a in axes)
    if opset >= 13:
        inits = ", ".join(f"int64[{len(a)}] a{i} = {{{', '.join(map(str, a))}}}"
                          for i, a in enumerate(axes))
        calls = [f"u{i} = Unsqueeze({'x' if i == 0 else f'u{i - 1}'}, a{i})"
                 for i in range(len(axes))]
        head = f"<{inits}>"
    else:
        calls = [f"u{i} = Unsqueeze <axes = [{', '.join(map(str, a))}]> "
                 f"({'x' if i == 0 else f'u{i - 1}'})" for i, a in enumerate(axes)]
        head = ""
    last = f"u{len(axes) - 1}"
    return model_from_text(f"""
        <ir_version: 8, opset_import: ["" : {opset}]>
        g (float[3,5] x) => (float[{','.join(['?'] * rank)}] y) {head} {{
          {chr(10).join(calls)}
          y = Neg({last})
        }}""")


def final_axes(model) -> list[int]:
    (node,) = [n for n in model.graph.node if n.op_type == "Unsqueeze"]
    if len(node.input) > 1:
        values = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
        return values[node.input[1]].tolist()
    return list(node.attribute[0].ints)


X = {"x": np.arange(15, dtype=np.float32).reshape(3, 5)}


@pytest.mark.parametrize("first, second, third, expected", [
    ([1], [2], [3], [1, 2, 3]),      # GPT-2's t[:, None, None, None]
    ([0], [1], [3], [0, 1, 3]),      # Falcon's t[None, None, :, None]
    ([0], [0], None, [0, 1]),        # each in front: the first moves to 1
    ([-1], [0], None, [0, 3]),       # negative: from the end of the inner result
    ([1, 3], [-1, 0], None, [0, 2, 4, 5]),
])
def test_chains_become_one_unsqueeze(first, second, third, expected):
    for opset in (11, 17):
        model = chain(first, second, third, opset)
        out, report = graphopt.optimize(model, [RULE])
        assert op_types(out) == ["Unsqueeze", "Neg"] and final_axes(out) == expected
        onnx.checker.check_model(out, full_check=True)
        assert_same_outputs(model, out, X, atol=0, rtol=0)
        assert_second_run_changes_nothing(out, [RULE])


def test_an_inner_unsqueeze_with_other_readers_stays():
    model = model_from_text("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[3,5] x) => (float[3,1,1,5] y, float[3,1,5] z)
          <int64[1] a = {1}, int64[1] b = {2}> {
          z = Unsqueeze(x, a)
          y = Unsqueeze(z, b)
        }""")
    assert_no_change(model, [RULE])


def test_computed_axes_stay():
    model = model_from_text("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[3,5] x, int64[1] a) => (float[?,?,?,?] y) <int64[1] b = {0}> {
          u = Unsqueeze(x, a)
          v = Unsqueeze(u, b)
          y = Neg(v)
        }""")
    assert_no_change(model, [RULE])


def test_level_1_includes_it():
    assert RULE in {r.name for r in graphopt.select_rules(level=1)}

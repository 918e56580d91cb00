"""remove_noop_arithmetic: x * 1, x / 1, x - 0, x + 0 -> x when that is x bit for bit."""
from __future__ import annotations

import numpy as np
import pytest
from support.models import (
    assert_no_change,
    assert_same_outputs,
    assert_second_run_changes_nothing,
    model_from_text,
    op_types,
    run_ort,
)

import graphopt

RULE = "remove_noop_arithmetic"
# -0.0, NaN and infinities among the inputs: the outputs must match bit for bit
X = np.array([[-0.0, 0.0, 1.5, -2.0], [np.nan, np.inf, -np.inf, 3.0]], np.float32)


def model(node: str, constant: str) -> str:
    return model_from_text(f"""
        <ir_version: 8, opset_import: ["" : 17]>
        g (float[2,4] x) => (float[2,4] y) <{constant}> {{
          {node}
          y = Neg(r)
        }}""")


def same_bits(a, b) -> bool:
    return run_ort(a, {"x": X})[0].tobytes() == run_ort(b, {"x": X})[0].tobytes()


@pytest.mark.parametrize("node, constant", [
    ("r = Mul(x, one)", "float one = {1.0}"),
    ("r = Mul(one, x)", "float[1] one = {1.0}"),     # either side, rank 1
    ("r = Mul(x, one)", "float[1,4] one = {1.0, 1.0, 1.0, 1.0}"),  # x's size on an axis
    ("r = Div(x, one)", "float one = {1.0}"),
    ("r = Sub(x, zero)", "float zero = {0.0}"),
    ("r = Add(x, zero)", "float zero = {-0.0}"),     # x + (-0.0) is x, -0.0 included
])
def test_the_identity_element_goes(node, constant):
    before = model(node, constant)
    out, report = graphopt.optimize(before, [RULE])
    assert op_types(out) == ["Neg"] and list(out.graph.node[0].input) == ["x"]
    assert report.rules[RULE].rewrites == 1
    assert same_bits(before, out)
    assert_second_run_changes_nothing(out, [RULE])


@pytest.mark.parametrize("node, constant", [
    ("r = Add(x, zero)", "float zero = {0.0}"),      # -0.0 + 0.0 is +0.0
    ("r = Sub(x, zero)", "float zero = {-0.0}"),     # -0.0 - (-0.0) is +0.0
    ("r = Div(one, x)", "float one = {1.0}"),        # 1 / x
    ("r = Mul(x, one)", "float[2] one = {1.0, 2.0}"),  # not the identity everywhere
    ("r = Add(x, zero)", "float[2] zero = {-0.0, 0.0}"),  # one +0.0 among the zeros
    ("r = Mul(x, one)", "float[3,1,1] one = {1.0, 1.0, 1.0}"),  # broadcasts x to [3,2,4]
])
def test_what_is_not_x_bit_for_bit_or_of_its_shape_stays(node, constant):
    if "[3,1,1]" in constant:
        before = model_from_text(f"""
            <ir_version: 8, opset_import: ["" : 17]>
            g (float[2,4] x) => (float[3,2,4] y) <{constant}> {{
              {node}
              y = Neg(r)
            }}""")
    elif "[2]" in constant:
        before = model_from_text(f"""
            <ir_version: 8, opset_import: ["" : 17]>
            g (float[2,2] x) => (float[2,2] y) <{constant}> {{
              {node}
              y = Neg(r)
            }}""")
    else:
        before = model(node, constant)
    assert_no_change(before, [RULE])


def test_the_sign_of_zero_is_why_float_add_of_zero_stays():
    plus = model("r = Add(x, zero)", "float zero = {0.0}")
    without = model("r = Identity(x)", "float zero = {0.0}")
    # -0.0 + 0.0 is +0.0: Neg gives -0.0 where Neg(x) gives +0.0
    assert np.signbit(run_ort(plus, {"x": X})[0][0, 0])
    assert not np.signbit(run_ort(without, {"x": X})[0][0, 0])


def test_integer_zero_is_always_the_identity():
    before = model_from_text("""
        <ir_version: 8, opset_import: ["" : 17]>
        g (int64[3] i) => (int64[3] y) <int64 zero = {0}> {
          r = Add(i, zero)
          y = Neg(r)
        }""")
    out, _ = graphopt.optimize(before, [RULE])
    assert op_types(out) == ["Neg"]
    assert_same_outputs(before, out, {"i": np.array([-1, 0, 5], np.int64)}, atol=0, rtol=0)


def test_level_1_includes_it():
    assert RULE in {r.name for r in graphopt.select_rules(level=1)}

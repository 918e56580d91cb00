"""transposed_matmul_to_fused_matmul: a Transpose of a product's last two dims becomes one
FusedMatMul of the swapped operands, (op(A) op(B))^T = op(B)^T op(A)^T."""
from __future__ import annotations

import itertools

import numpy as np
import onnx
import pytest
from onnx import helper
from support.models import (
    assert_declined,
    assert_level_2_only,
    assert_same_outputs,
    assert_second_run_changes_nothing,
    fused,
    fused_attrs,
    op_types,
    random_feeds,
)

import graphopt

RULE = "transposed_matmul_to_fused_matmul"
M, K, N = 5, 7, 4


def run(model, rules=(RULE,), **kw):
    return graphopt.optimize(model, list(rules), **kw)


def _swap_last_two(rank):
    return list(range(rank - 2)) + [rank - 1, rank - 2]


def transposed_product(rank, fused_flags=None, *, perm=None, extra_reader=False,
                       a_rank=None, b_rank=None, dtype=onnx.TensorProto.FLOAT, known=True):
    """y = Transpose(product(a, b), perm): the product a MatMul (``fused_flags`` None) or a
    FusedMatMul with (transA, transB, alpha)."""
    batch = [2, 3][:rank - 2]
    a_rank, b_rank = a_rank or rank, b_rank or rank
    trans_a, trans_b, alpha = fused_flags or (0, 0, 1.0)
    shape_a = batch[len(batch) - (a_rank - 2):] + ([K, M] if trans_a else [M, K])
    shape_b = batch[len(batch) - (b_rank - 2):] + ([N, K] if trans_b else [K, N])
    if a_rank == 1:
        shape_a = [K]
    if b_rank == 1:
        shape_b = [K]
    if fused_flags is None:
        product = helper.make_node("MatMul", ["a", "b"], ["p"], name="MM")
    else:
        product = helper.make_node("FusedMatMul", ["a", "b"], ["p"], name="MM",
                                   domain="com.microsoft", transA=trans_a, transB=trans_b,
                                   alpha=alpha)
    perm = perm if perm is not None else _swap_last_two(rank)
    nodes = [product, helper.make_node("Transpose", ["p"], ["y"], perm=perm, name="T")]
    p_shape = _product_shape(shape_a, shape_b, trans_a, trans_b)
    outputs = [helper.make_tensor_value_info("y", dtype, [p_shape[i] for i in perm])]
    if extra_reader:
        nodes.append(helper.make_node("Relu", ["p"], ["r"], name="R"))
        outputs.append(helper.make_tensor_value_info("r", dtype, p_shape))
    inputs = [helper.make_tensor_value_info("a", dtype, shape_a),
              helper.make_tensor_value_info("b", dtype, shape_b)]
    if not known:  # a read through a Reshape to a shape fed at run time: rank unknown
        inputs += [helper.make_tensor_value_info("a_shape", onnx.TensorProto.INT64, ["r"])]
        nodes.insert(0, helper.make_node("Reshape", ["a_flat", "a_shape"], ["a"], name="RS"))
        inputs[0] = helper.make_tensor_value_info("a_flat", dtype, [int(np.prod(shape_a))])
    graph = helper.make_graph(nodes, "g", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    return model


def _product_shape(shape_a, shape_b, trans_a, trans_b):
    a = np.zeros(shape_a)
    b = np.zeros(shape_b)
    if trans_a and a.ndim >= 2:
        a = a.swapaxes(-1, -2)
    if trans_b and b.ndim >= 2:
        b = b.swapaxes(-1, -2)
    return list(np.matmul(a, b).shape)


def _cases():
    for rank in (2, 3, 4):
        yield pytest.param(rank, None, id=f"r{rank}-MatMul")
        for trans_a, trans_b in itertools.product((0, 1), repeat=2):
            yield pytest.param(rank, (trans_a, trans_b, 0.5),
                               id=f"r{rank}-FusedMatMul-tA{trans_a}-tB{trans_b}")


@pytest.mark.parametrize("rank,flags", list(_cases()))
def test_the_transposed_product_becomes_one_fused_matmul_with_the_same_outputs(rank, flags):
    model = transposed_product(rank, flags)
    out, report = run(model)
    assert op_types(out) == ["FusedMatMul"]
    (node,) = fused(out)
    attrs = fused_attrs(node)
    trans_a, trans_b, alpha = flags or (0, 0, 1.0)
    assert list(node.input) == ["b", "a"]
    assert (attrs["transA"], attrs["transB"]) == (1 - trans_b, 1 - trans_a)
    assert attrs["alpha"] == pytest.approx(alpha)
    assert node.output[0] == "y"  # the graph output keeps its name
    assert report.rules[RULE].rewrites == 1
    assert_same_outputs(model, out)
    assert_second_run_changes_nothing(out, [RULE])


def test_a_transpose_without_perm_of_a_matrix_product_is_its_swap():
    # ONNX's default perm reverses the dims: for rank 2 the swap (how a tied weight's
    # gradient is transposed back)
    model = transposed_product(2, (1, 0, 1.0))
    del model.graph.node[1].attribute[:]
    out, _ = run(model)
    assert op_types(out) == ["FusedMatMul"]
    assert_same_outputs(model, out)


def test_declines_a_transpose_without_perm_of_a_batched_product():
    model = transposed_product(3, None, perm=[2, 1, 0])
    del model.graph.node[1].attribute[:]  # reverses all three dims
    assert_declined(model, RULE, "the Transpose does not swap just the last two dims")


def test_a_batch_operand_broadcast_against_a_matrix_is_rewritten_too():
    # (2, 3, M, K) @ (K, N): the matrix operand broadcasts; the swap keeps that
    model = transposed_product(4, None, b_rank=2)
    out, _ = run(model)
    assert op_types(out) == ["FusedMatMul"]
    assert_same_outputs(model, out)


def test_float16_products_are_rewritten_and_agree():
    model = transposed_product(3, (0, 1, 1.0), dtype=onnx.TensorProto.FLOAT16)
    out, _ = run(model)
    assert op_types(out) == ["FusedMatMul"]
    assert_same_outputs(model, out, rtol=1e-2, atol=1e-2)


def test_declines_when_the_product_has_another_reader():
    assert_declined(transposed_product(3, None, extra_reader=True), RULE,
                    "the product is read by more than the Transpose")


@pytest.mark.parametrize("perm", [[1, 0, 2], [2, 1, 0], [0, 1, 2]])
def test_declines_a_transpose_that_moves_other_dims(perm):
    assert_declined(transposed_product(3, None, perm=perm), RULE,
                    "the Transpose does not swap just the last two dims")


def test_declines_transbatch_flags():
    model = transposed_product(3, (0, 0, 1.0))
    model.graph.node[0].attribute.append(helper.make_attribute("transBatchA", 1))
    # a: (2, M, K) read with transBatchA as (M, 2, K) -> batch M, so give it that shape
    model.graph.input[0].type.tensor_type.shape.dim[0].dim_value = M
    model.graph.input[0].type.tensor_type.shape.dim[1].dim_value = 2
    assert_declined(model, RULE, "transBatch flags")


def test_declines_a_rank_one_operand():
    # (K,) @ (2, K, N) -> (2, N): the result's last two dims are not op(A)'s rows and op(B)'s
    # columns
    model = transposed_product(3, None, a_rank=1, perm=[1, 0])
    assert_declined(model, RULE, "a rank-1 operand")


def test_declines_operands_of_unknown_rank():
    assert_declined(transposed_product(3, None, known=False), RULE,
                    "an operand's rank is unknown")


def test_declines_integer_products():
    assert_declined(transposed_product(2, None, dtype=onnx.TensorProto.INT32), RULE,
                    "FusedMatMul needs float inputs")


def test_only_at_level_2():
    assert_level_2_only(transposed_product(3, None), RULE)


def test_the_executor_computes_the_rewritten_product_as_onnxruntime_does():
    from graphopt.executor import Session

    model = transposed_product(4, (1, 0, 0.25))
    out, _ = run(model)
    feeds = random_feeds(model)
    want = Session(model, device="cpu").run(feeds)["y"]
    got = Session(out, device="cpu").run(feeds)["y"]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)

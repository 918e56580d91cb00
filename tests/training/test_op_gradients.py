"""Every gradient definition against float64 central differences of the forward model.

Each case is a tiny float64 model: trainable initializers (all of them) and, where it
matters, graph inputs with ``input_grads``. The loss is sum(output * g) for a random g.
"""
from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from .helpers import DOUBLE, check_against_finite_differences, model

rng = np.random.default_rng(0)


def vi(name, shape, dtype=DOUBLE):
    return helper.make_tensor_value_info(name, dtype, shape)


def rand(*shape):
    return rng.standard_normal(shape)


def node(op_type, inputs, outputs, **attrs):
    return helper.make_node(op_type, inputs, outputs, name=f"{op_type}_{outputs[0]}", **attrs)


def one_op(op_type, params: dict, inputs: dict | None = None, out_shape=None, opset=17,
           consts: dict | None = None, n_outputs=1, **attrs):
    """Model ``y = op(*params, *inputs, *consts)`` (argument order as the dicts list them)."""
    inputs = inputs or {}
    consts = consts or {}
    names = list(params) + list(inputs) + list(consts)
    outs = ["y"] + [f"y{i}" for i in range(1, n_outputs)]
    m = model([node(op_type, names, outs, **attrs)],
              [vi(k, list(v.shape)) for k, v in inputs.items()],
              [vi(o, out_shape if i == 0 else None) for i, o in enumerate(outs)],
              {**params, **consts}, opset=opset)
    return m, inputs


def ints(*values):
    return np.array(values, dtype=np.int64)


CASES = {
    # matrix products: broadcast batch dims are summed away, 1-D operands promoted
    "matmul_2d": lambda: one_op("MatMul", {"a": rand(3, 4), "b": rand(4, 5)}),
    "matmul_batched_weight": lambda: one_op("MatMul", {"a": rand(2, 3, 4), "b": rand(4, 5)}),
    "matmul_broadcast_batch": lambda: one_op("MatMul", {"a": rand(2, 3, 4, 5),
                                                         "b": rand(3, 5, 2)}),
    "matmul_matrix_times_batch": lambda: one_op("MatMul", {"a": rand(4, 5), "b": rand(2, 5, 3)}),
    "matmul_size1_batch": lambda: one_op("MatMul", {"a": rand(2, 1, 3, 4), "b": rand(1, 3, 4, 2)}),
    "matmul_vector_left": lambda: one_op("MatMul", {"a": rand(4), "b": rand(2, 4, 3)}),
    "matmul_vector_right": lambda: one_op("MatMul", {"a": rand(2, 3, 4), "b": rand(4)}),
    "matmul_dot": lambda: one_op("MatMul", {"a": rand(4), "b": rand(4)}),
    "gemm_plain": lambda: one_op("Gemm", {"a": rand(3, 4), "b": rand(4, 5), "c": rand(5)}),
    "gemm_transposed_scaled": lambda: one_op(
        "Gemm", {"a": rand(4, 3), "b": rand(5, 4), "c": rand(3, 1)}, transA=1, transB=1,
        alpha=0.5, beta=2.0),
    "gemm_trans_a": lambda: one_op("Gemm", {"a": rand(4, 3), "b": rand(4, 5)}, transA=1),
    "gemm_trans_b": lambda: one_op("Gemm", {"a": rand(3, 4), "b": rand(5, 4), "c": rand(1, 1)},
                                   transB=1),
    # broadcasting arithmetic
    "add_broadcast": lambda: one_op("Add", {"a": rand(2, 3, 4), "b": rand(3, 1)}),
    "sub_broadcast": lambda: one_op("Sub", {"a": rand(3, 1), "b": rand(2, 3, 4)}),
    "mul_broadcast": lambda: one_op("Mul", {"a": rand(2, 1, 4), "b": rand(3, 1)}),
    "div_broadcast": lambda: one_op("Div", {"a": rand(2, 3), "b": rng.uniform(1, 2, (3,))}),
    "sum_three": lambda: one_op("Sum", {"a": rand(2, 3), "b": rand(3), "c": rand(1, 1)}),
    "pow_float_exponent": lambda: one_op("Pow", {"a": rng.uniform(0.5, 2, (2, 3)),
                                                  "b": rng.uniform(1, 2, (3,))}),
    "pow_integer_exponent": lambda: one_op("Pow", {"a": rand(2, 3)}, consts={"p": ints(3)}),
    # elementwise
    "sqrt": lambda: one_op("Sqrt", {"x": rng.uniform(0.5, 2, (2, 3))}),
    "reciprocal": lambda: one_op("Reciprocal", {"x": rng.uniform(0.5, 2, (2, 3))}),
    "exp": lambda: one_op("Exp", {"x": rand(2, 3)}),
    "log": lambda: one_op("Log", {"x": rng.uniform(0.5, 2, (2, 3))}),
    "neg": lambda: one_op("Neg", {"x": rand(2, 3)}),
    "erf": lambda: one_op("Erf", {"x": rand(2, 3)}),
    "tanh": lambda: one_op("Tanh", {"x": rand(2, 3)}),
    "sigmoid": lambda: one_op("Sigmoid", {"x": rand(2, 3)}),
    "relu": lambda: one_op("Relu", {"x": rand(3, 4)}),
    "softmax": lambda: one_op("Softmax", {"x": rand(2, 3, 4)}, axis=1),
    "softmax_opset11_coerced": lambda: one_op("Softmax", {"x": rand(2, 3, 4)}, opset=11, axis=1),
    "log_softmax": lambda: one_op("LogSoftmax", {"x": rand(2, 5)}),
    # data movement
    "transpose": lambda: one_op("Transpose", {"x": rand(2, 3, 4)}, perm=[2, 0, 1]),
    "transpose_default": lambda: one_op("Transpose", {"x": rand(2, 3, 4)}),
    "reshape": lambda: one_op("Reshape", {"x": rand(2, 3, 4)}, consts={"s": ints(4, -1)}),
    "flatten": lambda: one_op("Flatten", {"x": rand(2, 3, 4)}, axis=2),
    "squeeze": lambda: one_op("Squeeze", {"x": rand(2, 1, 4)}, consts={"axes": ints(1)}),
    "unsqueeze_opset11": lambda: one_op("Unsqueeze", {"x": rand(2, 4)}, opset=11, axes=[0, 2]),
    "expand": lambda: one_op("Expand", {"x": rand(3, 1)}, consts={"s": ints(2, 3, 4)}),
    "identity": lambda: one_op("Identity", {"x": rand(2, 3)}),
    "dropout_inference": lambda: one_op("Dropout", {"x": rand(2, 3)}),
    "where": lambda: _where(),
    "split_unused_piece": lambda: _split_with_unused_piece(),
    "concat": lambda: one_op("Concat", {"a": rand(2, 3), "b": rand(2, 1), "c": rand(2, 2)},
                             axis=-1),
    "concat_opset11": lambda: one_op("Concat", {"a": rand(3, 2), "b": rand(1, 2)}, opset=11,
                                     axis=0),
    "slice_steps": lambda: one_op("Slice", {"x": rand(4, 7)},
                                  consts={"s": ints(1, -1), "e": ints(4, 0), "ax": ints(0, 1),
                                          "st": ints(2, -2)}),
    "slice_opset9_attributes": lambda: one_op("Slice", {"x": rand(4, 6)}, opset=9,
                                              starts=[1], ends=[5], axes=[1]),
    "gather_repeated_indices": lambda: one_op("Gather", {"x": rand(5, 3)},
                                              consts={"i": ints(0, 2, 2, -1)}, axis=0),
    "gather_scalar_index": lambda: one_op("Gather", {"x": rand(2, 5, 3)},
                                          consts={"i": np.array(-2, np.int64)}, axis=1),
    "gather_elements": lambda: one_op("GatherElements", {"x": rand(3, 4)},
                                      consts={"i": ints(0, 3, 3, 1, 2, 2).reshape(3, 2)}, axis=1),
    "gather_nd": lambda: one_op("GatherND", {"x": rand(3, 4, 2)},
                                consts={"i": ints(0, 1, 2, 3, 0, 1).reshape(3, 2)}),
    # reductions
    "reduce_sum_drop_axis": lambda: one_op("ReduceSum", {"x": rand(2, 3, 4)},
                                           consts={"axes": ints(1)}, keepdims=0),
    "reduce_sum_opset11_all": lambda: one_op("ReduceSum", {"x": rand(2, 3)}, opset=11,
                                             keepdims=0),
    "reduce_mean_keepdims": lambda: one_op("ReduceMean", {"x": rand(2, 3, 4)}, axes=[0, 2]),
    "reduce_mean_opset18_input_axes": lambda: one_op("ReduceMean", {"x": rand(2, 3, 4)},
                                                     opset=18, consts={"axes": ints(-1)},
                                                     keepdims=0),
    # layers
    "layer_norm": lambda: one_op("LayerNormalization", {"x": rand(2, 3, 4), "s": rand(4),
                                                         "b": rand(4)}, axis=-1),
    "layer_norm_two_axes_no_bias": lambda: one_op("LayerNormalization",
                                                  {"x": rand(2, 3, 4), "s": rand(3, 4)}, axis=1),
    "conv_grouped_strided": lambda: one_op("Conv", {"x": rand(1, 4, 6, 5), "w": rand(4, 2, 3, 2),
                                                    "b": rand(4)}, group=2, strides=[2, 1],
                                           pads=[1, 0, 1, 1]),
    "conv_no_bias_dilated": lambda: one_op("Conv", {"x": rand(2, 1, 7, 7), "w": rand(2, 1, 2, 2)},
                                           dilations=[2, 2]),
    "maxpool_overlapping": lambda: one_op("MaxPool", {"x": rand(2, 2, 5, 5)},
                                          kernel_shape=[3, 3], strides=[1, 1]),
    "maxpool_opset11_padded": lambda: one_op("MaxPool", {"x": rand(1, 2, 5, 4)}, opset=11,
                                             kernel_shape=[2, 2], strides=[2, 2],
                                             pads=[1, 0, 0, 0]),
}


def _where():
    m = model([node("Where", ["cond", "a", "b"], ["y"])], [], [vi("y", [2, 3])],
              {"cond": rng.random((2, 3)) > 0.5, "a": rand(2, 3), "b": rand(3)})
    return m, {}


def _split_with_unused_piece():
    x = rand(2, 6)
    m = model([node("Split", ["x", "sizes"], ["p0", "p1", "p2"], axis=1),
               node("Mul", ["p0", "p2"], ["y"])],
              [], [vi("y", [2, 2])], {"x": x, "sizes": ints(2, 2, 2)})
    return m, {}


@pytest.mark.parametrize("case", list(CASES))
def test_gradient_matches_finite_differences(case):
    forward, feeds = CASES[case]()
    check_against_finite_differences(forward, feeds, rtol=1e-5, atol=1e-7)


# ---- graphs that exercise the backward pass as a whole ---------------------------------------
def test_dynamic_dims_use_runtime_shapes():
    """Unknown dims: broadcast axes and split sizes are computed from Shape at run time."""
    nodes = [
        node("Add", ["x", "bias"], ["h"]),  # 'n' x 'm' + [m]: m vs a symbol -> runtime axes
        node("Concat", ["h", "x"], ["c"], axis=0),  # dynamic split sizes
        node("Tanh", ["c"], ["t"]),
        node("ReduceMean", ["t"], ["y"], axes=[0], keepdims=1),  # dynamic element count
    ]
    forward = model(nodes, [vi("x", ["n", "m"])], [vi("y", None)], {"bias": rand(3)})
    training = check_against_finite_differences(forward, {"x": rand(5, 3)}, input_grads=["x"],
                                                rtol=1e-5, atol=1e-7)
    op_types = {n.op_type for n in training.proto.graph.node}
    assert {"Shape", "BroadcastGradientArgs"} <= op_types


def test_shared_tensors_accumulate_with_sum():
    nodes = [node("Mul", ["w", "w"], ["sq"]),  # w used twice by one node
             node("MatMul", ["x", "w"], ["xw"]),  # and once more elsewhere
             node("Add", ["sq", "xw"], ["y"])]
    forward = model(nodes, [vi("x", [3, 3])], [vi("y", [3, 3])], {"w": rand(3, 3)})
    training = check_against_finite_differences(forward, {"x": rand(3, 3)}, input_grads=["x"],
                                                rtol=1e-5, atol=1e-7)
    assert "Sum" in {n.op_type for n in training.proto.graph.node}


def test_integer_branch_is_not_differentiated():
    """Shape arithmetic on a trained tensor carries no gradient: no definition is needed."""
    nodes = [node("Shape", ["w"], ["s"]),
             node("Cast", ["s"], ["sf"], to=DOUBLE),  # a float computed from the shape only
             node("Reshape", ["w", "s"], ["r"]),
             node("Mul", ["r", "k"], ["y"])]
    forward = model(nodes, [], [vi("y", [2, 3])], {"w": rand(2, 3), "k": rand(2, 3)})
    check_against_finite_differences(forward, {}, rtol=1e-5, atol=1e-7)


def test_cast_round_trip_passes_the_gradient_through():
    nodes = [node("Cast", ["w"], ["w32"], to=TensorProto.FLOAT),
             node("Cast", ["w32"], ["y"], to=DOUBLE)]
    forward = model(nodes, [], [vi("y", [2, 3])], {"w": rand(2, 3)})
    from graphopt.training import build_training_graph

    from .helpers import run_training

    g = rand(2, 3)
    result = run_training(build_training_graph(forward, loss="output"), {"y_grad": g})
    np.testing.assert_allclose(result["w_grad"], g.astype(np.float32), rtol=1e-7)

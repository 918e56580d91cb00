"""com.microsoft gradient kernels vs float64 central finite differences of our own forward
kernels (run through the Session on one-node graphs)."""

from __future__ import annotations

import numpy as np
import pytest

from .helpers import MS, numeric_grad, run_single

RNG = np.random.default_rng(1234)


def _randn(*shape):
    return RNG.standard_normal(shape)


def _fwd(op_type, opset=17, domain="", n_outputs=1, attrs=None, **fixed):
    """f(x) = op(x, **fixed)[0] for the first input named 'x'."""

    def f(x):
        return run_single(op_type, {"x": x, **fixed}, n_outputs, domain, opset, attrs)[0]

    return f


def _assert_gradients(f, args, grads, dy, rtol, atol=1e-7):
    """Each of ``grads`` is the numerical gradient of ``f(*args)`` in its argument."""
    for index, grad in enumerate(grads):
        def f_of_one(value, index=index):
            return f(*args[:index], value, *args[index + 1:])
        np.testing.assert_allclose(grad, numeric_grad(f_of_one, args[index], dy), rtol=rtol,
                                   atol=atol, err_msg=f"gradient of argument {index}")


def _grad(op_type, inputs, n_outputs=1, attrs=None):
    return run_single(op_type, inputs, n_outputs, MS, 17, attrs)


@pytest.mark.parametrize("axis", [1, -1])
def test_softmax_grad_13(axis):
    x, dy = _randn(2, 3, 4), _randn(2, 3, 4)
    f = _fwd("Softmax", 13, attrs={"axis": axis})
    (dx,) = _grad("SoftmaxGrad_13", {"dy": dy, "y": f(x)}, attrs={"axis": axis})
    np.testing.assert_allclose(dx, numeric_grad(f, x, dy), rtol=1e-6, atol=1e-8)


def test_softmax_grad_pre13_coerces_to_2d():
    x, dy = _randn(2, 3, 4), _randn(2, 3, 4)
    f = _fwd("Softmax", 11, attrs={"axis": 1})
    (dx,) = _grad("SoftmaxGrad", {"dy": dy, "y": f(x)}, attrs={"axis": 1})
    np.testing.assert_allclose(dx, numeric_grad(f, x, dy), rtol=1e-6, atol=1e-8)


def test_log_softmax_grad_13():
    x, dy = _randn(3, 5), _randn(3, 5)
    f = _fwd("LogSoftmax", 13)
    (dx,) = _grad("LogSoftmaxGrad_13", {"dy": dy, "y": f(x)})
    np.testing.assert_allclose(dx, numeric_grad(f, x, dy), rtol=1e-6, atol=1e-8)


def test_gather_grad_accumulates_repeated_and_negative_indices():
    x = _randn(3, 5, 2)
    indices = np.array([[0, 4], [-1, 2], [0, 0]], dtype=np.int64)
    f = _fwd("Gather", attrs={"axis": 1}, indices=indices)
    dy = _randn(*f(x).shape)
    shape = np.array(x.shape, dtype=np.int64)
    (dx,) = _grad("GatherGrad", {"shape": shape, "indices": indices, "dy": dy}, attrs={"axis": 1})
    np.testing.assert_allclose(dx, numeric_grad(f, x, dy), rtol=1e-6, atol=1e-8)


def test_slice_grad():
    x = _randn(4, 6)
    starts, ends = np.array([1, -1], np.int64), np.array([4, 0], np.int64)
    axes, steps = np.array([0, 1], np.int64), np.array([2, -2], np.int64)
    f = _fwd("Slice", starts=starts, ends=ends, axes=axes, steps=steps)
    dy = _randn(*f(x).shape)
    (dx,) = _grad("SliceGrad", {"dy": dy, "shape": np.array(x.shape, np.int64), "starts": starts,
                                "ends": ends, "axes": axes, "steps": steps})
    np.testing.assert_allclose(dx, numeric_grad(f, x, dy), rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("grad_op, fwd_op, fwd_domain, fwd_opset, fwd_attrs", [
    ("ReluGrad", "Relu", "", 17, None),
    ("GeluGrad", "Gelu", MS, 17, None),
    ("FastGeluGrad", "FastGelu", MS, 17, None),
    ("GeluGrad", "Gelu", "", 20, None),
])
def test_activation_grads(grad_op, fwd_op, fwd_domain, fwd_opset, fwd_attrs):
    x = _randn(4, 7) * 2
    x[np.abs(x) < 1e-3] = 0.5  # keep away from Relu's kink
    dy = _randn(4, 7)
    f = _fwd(fwd_op, fwd_opset, fwd_domain, attrs=fwd_attrs)
    (dx,) = _grad(grad_op, {"dy": dy, "x": x})
    np.testing.assert_allclose(dx, numeric_grad(f, x, dy), rtol=1e-6, atol=1e-8)


def test_bias_gelu_grad_dx():
    x, b, dy = _randn(3, 8), _randn(8), _randn(3, 8)
    f = _fwd("BiasGelu", domain=MS, bias=b)
    (dx,) = _grad("BiasGeluGrad_dX", {"dy": dy, "x": x, "b": b})
    np.testing.assert_allclose(dx, numeric_grad(f, x, dy), rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("axis", [-1, 1])
def test_layer_normalization_grad(axis):
    x = _randn(2, 3, 4)
    norm_shape = x.shape[axis:] if axis != -1 else x.shape[-1:]
    scale, bias = _randn(*norm_shape), _randn(*norm_shape)
    attrs = {"axis": axis, "epsilon": 1e-5}
    dy = _randn(*x.shape)
    _, mean, inv_std = run_single("LayerNormalization", {"x": x, "s": scale, "b": bias}, 3,
                                  attrs=attrs)
    dx, dscale, dbias = _grad("LayerNormalizationGrad",
                              {"dy": dy, "x": x, "s": scale, "mean": mean, "inv_std": inv_std}, 3,
                              attrs={"axis": axis})

    def ln(x_, s_, b_):
        return run_single("LayerNormalization", {"x": x_, "s": s_, "b": b_}, 1, attrs=attrs)[0]

    _assert_gradients(ln, (x, scale, bias), (dx, dscale, dbias), dy, rtol=1e-5)


@pytest.mark.parametrize("attrs", [
    {"strides": [2, 1], "pads": [1, 0, 1, 2], "group": 2},
    {"dilations": [2, 2], "auto_pad": "SAME_UPPER"},
])
def test_conv_grad(attrs):
    x, w, b = _randn(2, 4, 5, 6), _randn(6, 4 // attrs.get("group", 1), 3, 2), _randn(6)

    def conv(x_, w_, b_):
        return run_single("Conv", {"x": x_, "w": w_, "b": b_}, attrs=attrs)[0]

    dy = _randn(*conv(x, w, b).shape)
    dx, dw, db = _grad("ConvGrad", {"dy": dy, "x": x, "w": w}, 3, attrs=attrs)
    _assert_gradients(conv, (x, w, b), (dx, dw, db), dy, rtol=1e-6)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("weighted", [False, True])
def test_softmax_cross_entropy_loss_grad(reduction, weighted):
    scores = _randn(4, 5, 3)
    labels = np.array([[0, 4, 2], [1, 1, -100], [3, 0, 2], [-100, 4, 4]], dtype=np.int64)
    extra = {"weights": RNG.random(5) + 0.5} if weighted else {}
    attrs = {"reduction": reduction, "ignore_index": -100}

    def loss(s):
        return run_single("SoftmaxCrossEntropyLoss", {"x": s, "labels": labels, **extra}, 2,
                          attrs=attrs)

    value, log_prob = loss(scores)
    dy = np.array(1.7) if reduction != "none" else _randn(*labels.shape)
    inputs = {"dy": dy, "log_prob": log_prob, "labels": labels, **extra}
    (dscores,) = _grad("SoftmaxCrossEntropyLossGrad", inputs, attrs=attrs)
    expected = numeric_grad(lambda s: loss(s)[0], scores, dy)
    np.testing.assert_allclose(dscores, expected, rtol=1e-6, atol=1e-8)


def test_dropout_grad_uses_mask_and_ratio_only_in_training_mode():
    dy = _randn(3, 4)
    mask = RNG.random((3, 4)) > 0.3
    ratio = np.array(0.3, np.float32)
    (train,) = _grad("DropoutGrad", {"dy": dy, "mask": mask, "ratio": ratio, "t": np.array(True)})
    np.testing.assert_allclose(train, dy * mask / 0.7)
    (infer,) = _grad("DropoutGrad", {"dy": dy, "mask": mask, "ratio": ratio, "t": np.array(False)})
    np.testing.assert_array_equal(infer, dy)


def test_dropout_and_its_grad_without_training_mode_follow_the_session():
    from onnx import TensorProto, helper

    from graphopt.executor import Session

    nodes = [helper.make_node("Dropout", ["x", "r"], ["y", "mask"]),
             helper.make_node("DropoutGrad", ["dy", "mask", "r"], ["dx"], domain=MS)]
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [64]) for n in ("x", "dy")],
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, [64]) for n in ("y", "dx")],
        [helper.make_tensor("r", TensorProto.FLOAT, [], [0.5])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid(MS, 1)])
    ones = {"x": np.ones(64, np.float32), "dy": np.ones(64, np.float32)}
    out = Session(model, device="cpu", training=True, seed=0).run(ones)
    np.testing.assert_array_equal(out["dx"], out["y"])  # same mask, same scale, both ways
    assert 0 < (out["y"] == 0).sum() < 64
    out = Session(model, device="cpu", training=False).run(ones)
    np.testing.assert_array_equal(out["dx"], ones["dy"])

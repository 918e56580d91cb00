"""The NumPy fast paths of the small training kernels: LayerNormalization and its
gradient, SoftmaxGrad, SoftmaxCrossEntropyLoss and its gradient, ReduceSum. Each is checked
against float64 formulas written here, on the shapes it takes and on those it must leave to
the general path (parameters that broadcast, non-trailing axes, wide-spread scores, ignored
labels, half precision)."""

import numpy as np
import pytest

from graphopt.executor.backend import select_backend
from graphopt.executor.context import KernelContext
from graphopt.executor.kernels import _compiled, loss, nn, reduce, training_ops
from graphopt.executor.kernels._util import column_dots, max_over, row_dots, row_max
from graphopt.executor.plan import PlannedNode

RNG = np.random.default_rng(11)


def _ctx(*donated):
    ctx = KernelContext(select_backend("cpu"), None, True, 0)
    ctx.donated = donated
    return ctx


def _node(op_type, domain="com.microsoft", opset=1, **attrs):
    return PlannedNode(0, op_type, op_type, domain, opset, (), (), attrs)


def _ln_reference(x, scale, bias, axis):
    axes = tuple(range(axis, x.ndim))
    x = x.astype(np.float64)
    mean = x.mean(axis=axes, keepdims=True)
    inv_std = 1 / np.sqrt(((x - mean) ** 2).mean(axis=axes, keepdims=True) + 1e-5)
    return (x - mean) * inv_std * scale + bias, mean, inv_std


def _ln_grad_reference(dy, x, scale, axis):
    axes, lead = tuple(range(axis, x.ndim)), tuple(range(axis))
    dy, x = dy.astype(np.float64), x.astype(np.float64)
    mean = x.mean(axis=axes, keepdims=True)
    inv_std = 1 / np.sqrt(((x - mean) ** 2).mean(axis=axes, keepdims=True) + 1e-5)
    xhat = (x - mean) * inv_std
    dxhat = dy * scale
    dx = inv_std * (dxhat - dxhat.mean(axis=axes, keepdims=True)
                    - xhat * (dxhat * xhat).mean(axis=axes, keepdims=True))
    scale_grad = (dy * xhat).sum(axis=lead)
    bias_grad = np.broadcast_to(dy, np.broadcast_shapes(dy.shape, x.shape)).sum(axis=lead)
    reduce_to = scale.shape
    while scale_grad.ndim > len(reduce_to):  # parameters that broadcast over leading axes
        scale_grad, bias_grad = scale_grad.sum(axis=0), bias_grad.sum(axis=0)
    for i, n in enumerate(reduce_to):
        if n == 1:
            scale_grad = scale_grad.sum(axis=i, keepdims=True)
            bias_grad = bias_grad.sum(axis=i, keepdims=True)
    return dx, scale_grad, bias_grad


# (x shape, axis, parameter shape): flat rows; two normalized axes; a parameter that
# broadcasts (the general path); axis 0 (one row)
LN_CASES = [((4, 6, 16), -1, (16,)), ((3, 5, 4, 8), -2, (4, 8)), ((3, 5, 8), -2, (1, 8)),
            ((6, 10), 0, (6, 10))]


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("shape,axis,param_shape", LN_CASES)
def test_layer_normalization_and_its_gradient(dtype, shape, axis, param_shape, kernel_path):
    x = (RNG.standard_normal(shape) * 3 + 5).astype(dtype)  # an offset: centred before squared
    scale = RNG.standard_normal(param_shape).astype(dtype)
    bias = RNG.standard_normal(param_shape).astype(dtype)
    tol = {"rtol": 2e-2, "atol": 2e-2} if dtype == np.float16 else {"rtol": 1e-4, "atol": 1e-5}
    node = _node("LayerNormalization", "", 17, axis=axis, epsilon=1e-5, stash_type=1)
    y, mean, inv_std = nn.layer_normalization(_ctx(), node, x, scale, bias)
    want_y, want_mean, want_inv = _ln_reference(x, scale, bias, axis % x.ndim)
    stash = np.promote_types(dtype, np.float32)  # stash_type 1: at least float32
    assert y.dtype == dtype and mean.dtype == inv_std.dtype == stash
    assert mean.shape == want_mean.shape and inv_std.shape == want_inv.shape
    np.testing.assert_allclose(y.astype(np.float64), want_y, **tol)
    np.testing.assert_allclose(mean, want_mean, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(inv_std, want_inv, rtol=1e-4)

    dy = RNG.standard_normal(shape).astype(dtype)
    dx, dscale, dbias = training_ops.layer_normalization_grad(
        _ctx(), _node("LayerNormalizationGrad", axis=axis), dy, x, scale, mean, inv_std)
    want = _ln_grad_reference(dy, x, scale, axis % x.ndim)
    for got, expected in zip((dx, dscale, dbias), want, strict=True):
        assert got.dtype == dtype and got.shape == expected.shape
        np.testing.assert_allclose(got.astype(np.float64), expected,
                                   **({"rtol": 5e-2, "atol": 5e-2} if dtype == np.float16
                                      else {"rtol": 1e-4, "atol": 1e-4}))


def _softmax(x, axis):
    e = np.exp(x - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def _with_specials(x):
    """x with NaN, +-inf and signed zeros scattered over its rows (a row of -inf too)."""
    x = x.copy()
    flat = x.reshape(-1)
    picks = RNG.choice(flat.size, size=(5, max(1, flat.size // 50)), replace=False)
    for pick, value in zip(picks, (np.nan, np.inf, -np.inf, 0.0, -0.0), strict=True):
        flat[pick] = value
    x.reshape(-1, x.shape[-1])[1] = -np.inf
    return x


@pytest.mark.parametrize("width", [2, 16, 32, 33, 48, 49, 64, 256])
@pytest.mark.parametrize("rows", [8, 127, 128, 4096])
def test_row_max_is_numpy_max(rows, width):
    x = _with_specials(RNG.standard_normal((rows, width)).astype(np.float32))
    with np.errstate(invalid="ignore"):
        np.testing.assert_array_equal(row_max(np, x), x.max(axis=1))
        view = x[::-1, :]  # rows read backwards: a view that is not C-contiguous
        np.testing.assert_array_equal(row_max(np, view), view.max(axis=1))


@pytest.mark.parametrize(("shape", "axis"), [
    ((32, 56, 32), 1), ((32, 57, 32), 1), ((4, 3, 2048, 2), 2), ((1, 30000, 16), 1),
    ((2, 513, 33), 1), ((64, 300, 1), 1), ((8, 56, 128), 1), ((16, 7, 3), 1),
    ((4096, 32), 0), ((64, 32, 17), 0)])
def test_max_over_is_numpy_max(shape, axis):
    """Halving an inner axis (max_over) finds NumPy's maxima, NaN, infinities and all."""
    x = _with_specials(RNG.standard_normal(shape).astype(np.float32))
    with np.errstate(invalid="ignore"):
        got = max_over(np, x, (axis,))
        np.testing.assert_array_equal(got, x.max(axis=axis, keepdims=True))
        assert got.shape == x.max(axis=axis, keepdims=True).shape
        view = np.flip(x, axis=0)  # not C-contiguous: NumPy's own reduction
        np.testing.assert_array_equal(max_over(np, view, (axis,)),
                                      view.max(axis=axis, keepdims=True))


@pytest.mark.parametrize("width", [7, 64, 256])
def test_row_and_column_dots_are_sums_of_products(width):
    a, b = RNG.standard_normal((2, 300, width)).astype(np.float32)
    exact = a.astype(np.float64) * b
    np.testing.assert_allclose(row_dots(np, a, b), exact.sum(axis=1), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(column_dots(np, a, b), exact.sum(axis=0), rtol=1e-5, atol=1e-5)


@pytest.mark.filterwarnings("ignore:invalid value:RuntimeWarning")  # -inf - -inf, on threads
@pytest.mark.parametrize("shape", [(32, 4, 32, 32), (2, 3, 40, 48), (1, 8, 256, 256),
                                   (4, 64, 7)])
def test_softmax_rows_have_the_bits_of_a_plain_max(shape, monkeypatch):
    """Narrow rows take row_max's transposed path: the maximum is the same, so every bit of
    the result is what the max-subtract-exp-sum-scale passes give with NumPy's max (the
    NumPy passes: tests/executor/test_compiled_kernels.py checks the compiled ones)."""
    monkeypatch.setenv(_compiled.ENV_SWITCH, "0")
    x = _with_specials(RNG.standard_normal(shape).astype(np.float32) * 4)
    with np.errstate(invalid="ignore"):
        rows = x.reshape(-1, shape[-1])
        e = np.exp(rows - rows.max(axis=1, keepdims=True))
        total = np.einsum("ij->i", e)
        np.reciprocal(total, out=total)
        want = (e * total[:, None]).reshape(shape)
        got = nn.softmax(_ctx(), _node("Softmax", domain="", opset=13, axis=-1), x)
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("op,axis", [("SoftmaxGrad_13", -1), ("SoftmaxGrad_13", 1),
                                     ("SoftmaxGrad", 1), ("SoftmaxGrad", 2)])
def test_softmax_grad_on_trailing_and_inner_axes(op, axis, kernel_path):
    shape = (3, 4, 5, 6)
    y64 = _softmax(RNG.standard_normal(shape), axis if op == "SoftmaxGrad_13"
                   else tuple(range(axis, 4)))
    dy = RNG.standard_normal(shape).astype(np.float32)
    y = y64.astype(np.float32)
    axes = (axis % 4,) if op == "SoftmaxGrad_13" else tuple(range(axis, 4))
    want = y * (dy - (y.astype(np.float64) * dy).sum(axis=axes, keepdims=True))
    fn = training_ops.softmax_grad_13 if op == "SoftmaxGrad_13" else training_ops.softmax_grad
    got = fn(_ctx(), _node(op, axis=axis), dy, y)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)


def test_softmax_grad_writes_into_a_donated_gradient(kernel_path):
    y = _softmax(RNG.standard_normal((4, 8, 8)), -1).astype(np.float32)
    dy = RNG.standard_normal((4, 8, 8)).astype(np.float32)
    want = training_ops.softmax_grad_13(_ctx(), _node("SoftmaxGrad_13", axis=-1), dy, y)
    donated = dy.copy()
    got = training_ops.softmax_grad_13(_ctx(donated), _node("SoftmaxGrad_13", axis=-1),
                                       donated, y)
    assert got is donated
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("donate", [False, True])
def test_softmax_grad_keeps_the_attention_layout_of_its_inputs(kernel_path, donate):
    """Attention probabilities and their gradient in (b, h, s, t) over (b, s, h, t) memory:
    the rows are read where they lie and dx comes out in the same layout, donated or not,
    with the values of the contiguous computation."""
    shape = (2, 5, 3, 16)  # (b, s, h, t) in memory
    y = _softmax(RNG.standard_normal(shape), -1).astype(np.float32).transpose(0, 2, 1, 3)
    dy = RNG.standard_normal(shape).astype(np.float32).transpose(0, 2, 1, 3)
    node = _node("SoftmaxGrad_13", axis=-1)
    want = training_ops.softmax_grad_13(_ctx(), node, np.ascontiguousarray(dy),
                                        np.ascontiguousarray(y))
    got = training_ops.softmax_grad_13(_ctx(dy) if donate else _ctx(), node, dy, y)
    assert (got is dy) == donate
    assert got.strides == y.strides
    np.testing.assert_array_equal(got, want)


def _sce_reference(scores, labels, ignore_index=None):
    x = scores.astype(np.float64)
    log_prob = x - x.max(axis=1, keepdims=True)
    log_prob -= np.log(np.exp(log_prob).sum(axis=1, keepdims=True))
    keep = np.ones(labels.shape, bool) if ignore_index is None else labels != ignore_index
    safe = np.where(keep, labels, 0)
    picked = np.take_along_axis(log_prob, safe[:, None], axis=1)[:, 0]
    loss_value = -(picked * keep).sum() / keep.sum()
    grad = np.exp(log_prob)
    np.put_along_axis(grad, safe[:, None], np.take_along_axis(grad, safe[:, None], 1) - 1, 1)
    grad *= (keep / keep.sum())[:, None]
    return loss_value, log_prob, grad


# scores of a moderate spread (one shift for the tensor), a wide one (a shift per class
# axis: exp(x - global max) would underflow a whole slice), (N, C) and (N, C, D1, D2) shapes
@pytest.mark.parametrize("shape,spread", [((6, 7, 5), 3.0), ((6, 7, 5), 400.0), ((9, 11), 3.0),
                                          ((4, 5, 3, 2), 3.0), ((6, 7, 5), np.inf)])
@pytest.mark.parametrize("ignore", [None, 2])
def test_softmax_cross_entropy_and_its_gradient(shape, spread, ignore, kernel_path):
    scores = RNG.standard_normal(shape).astype(np.float32)
    if np.isfinite(spread):
        scores[0] *= spread  # a slice far from the others
    labels = RNG.integers(0, shape[1], (shape[0],) + shape[2:]).astype(np.int64)
    if ignore is not None:
        labels.reshape(-1)[::4] = ignore  # ignored positions, others keep class 2
    attrs = {"reduction": "mean"} | ({} if ignore is None else {"ignore_index": ignore})
    ctx = _ctx()
    loss_value, log_prob = loss.softmax_cross_entropy_loss(
        ctx, _node("SoftmaxCrossEntropyLoss", "", 13, **attrs), scores, labels)
    if not np.isfinite(spread):
        scores[0, 0] = np.inf
        _, log_prob_inf = loss.softmax_cross_entropy_loss(
            ctx, _node("SoftmaxCrossEntropyLoss", "", 13, **attrs), scores, labels)
        assert np.isnan(log_prob_inf[0]).any() and np.isfinite(log_prob_inf[1:]).all()
        return
    want_loss, want_log_prob, want_grad = _sce_reference(scores, labels, ignore)
    assert np.isfinite(log_prob).all()
    np.testing.assert_allclose(log_prob, want_log_prob, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(loss_value, want_loss, rtol=1e-5)
    dy = np.array(1.0, np.float32)
    grad = loss.softmax_cross_entropy_loss_grad(
        ctx, _node("SoftmaxCrossEntropyLossGrad", **attrs), dy, log_prob, labels)
    assert grad.dtype == np.float32
    np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-7)


# scores as views whose classes are not where a C-contiguous (N, C, ...) array has them: a
# language model's logits (N, T, C) transposed to (N, C, T); (N, D2, D1, C) memory seen as
# (N, C, D1, D2), where no reshape to (N, C, D1 * D2) is a view (the gradient's -1 at the
# labels was once written into such a copy and lost)
@pytest.mark.parametrize("memory_shape,perm", [((4, 6, 5), (0, 2, 1)),
                                               ((2, 5, 3, 4), (0, 3, 2, 1)),
                                               ((16, 64, 56), (0, 2, 1))])
@pytest.mark.parametrize("ignore", [None, 1])
def test_cross_entropy_over_transposed_scores(memory_shape, perm, ignore, kernel_path):
    scores = (RNG.standard_normal(memory_shape) * 3).astype(np.float32).transpose(perm)
    labels = RNG.integers(0, scores.shape[1], (scores.shape[0],) + scores.shape[2:])
    if ignore is not None:
        labels.reshape(-1)[::3] = ignore
    attrs = {"reduction": "mean"} | ({} if ignore is None else {"ignore_index": ignore})
    loss_value, log_prob = loss.softmax_cross_entropy_loss(
        _ctx(), _node("SoftmaxCrossEntropyLoss", "", 13, **attrs), scores, labels)
    want_loss, want_log_prob, want_grad = _sce_reference(scores, labels, ignore)
    np.testing.assert_allclose(log_prob, want_log_prob, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(loss_value, want_loss, rtol=1e-5)
    assert log_prob.strides == np.empty_like(scores).strides  # laid out as the scores
    node = _node("SoftmaxCrossEntropyLossGrad", **attrs)
    dy = np.array(1.0, np.float32)
    grad = loss.softmax_cross_entropy_loss_grad(_ctx(), node, dy, log_prob, labels)
    np.testing.assert_allclose(grad, want_grad, rtol=1e-5, atol=1e-7)
    # a donated log_prob that is a view (as the compiled path's is) takes the gradient in place
    donated = log_prob.copy(order="K")[...]
    got = loss.softmax_cross_entropy_loss_grad(_ctx(donated), node, dy, donated, labels)
    assert got is donated
    np.testing.assert_array_equal(got, grad)


def test_cross_entropy_gradient_writes_into_a_donated_log_prob():
    scores = RNG.standard_normal((4, 6, 3)).astype(np.float32)
    labels = RNG.integers(0, 6, (4, 3)).astype(np.int64)
    node = _node("SoftmaxCrossEntropyLossGrad", reduction="sum")
    _, log_prob = loss.softmax_cross_entropy_loss(
        _ctx(), _node("SoftmaxCrossEntropyLoss", "", 13, reduction="sum"), scores, labels)
    dy = np.array(0.5, np.float32)
    want = loss.softmax_cross_entropy_loss_grad(_ctx(), node, dy, log_prob, labels)
    donated = log_prob.copy()
    got = loss.softmax_cross_entropy_loss_grad(_ctx(donated), node, dy, donated, labels)
    assert got is donated
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("axes", [(0,), (0, 1), (2,), (1, 2), (1,), (0, 2), (0, 1, 2)])
@pytest.mark.parametrize("keepdims", [0, 1])
@pytest.mark.parametrize("dtype", [np.float32, np.float16, np.int64])
def test_reduce_sum_over_leading_trailing_and_other_axes(axes, keepdims, dtype):
    x = (RNG.standard_normal((6, 5, 7)) * 4).astype(dtype)
    got = reduce.reduce_sum(np, x, axes, bool(keepdims))
    want = x.astype(np.float64).sum(axis=axes, keepdims=bool(keepdims))
    assert got.dtype == dtype and got.shape == want.shape
    np.testing.assert_allclose(got.astype(np.float64), want,
                               rtol=1e-2 if dtype == np.float16 else 1e-5, atol=1e-2)


def test_row_paths_return_arrays_the_next_kernel_may_overwrite(kernel_path):
    # a reshaped (rows, D) array is a view (it has a base): Session.run would not donate it
    # to the next in-place kernel, which then writes into another input's layout
    x = RNG.standard_normal((4, 6, 16)).astype(np.float32)
    scale, bias = (RNG.standard_normal(16).astype(np.float32) for _ in range(2))
    node = _node("LayerNormalization", "", 17, axis=-1, epsilon=1e-5, stash_type=1)
    y, mean, inv_std = nn.layer_normalization(_ctx(), node, x, scale, bias)
    dx, _, _ = training_ops.layer_normalization_grad(
        _ctx(), _node("LayerNormalizationGrad", axis=-1), x.copy(), x, scale, mean, inv_std)
    probs = _softmax(x, -1).astype(np.float32)
    dsoft = training_ops.softmax_grad_13(_ctx(), _node("SoftmaxGrad_13", axis=-1), x, probs)
    for result in (y, dx, dsoft):
        assert result.base is None and result.flags.c_contiguous

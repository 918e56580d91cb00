"""The compiled float32 kernels: each against float64 and against the NumPy passes
it replaces, in place and out of place, at the edges (NaN, infinities, masked -inf scores,
underflow), in every thread block; and the gate that decides when they run."""

import math
import sys

import numpy as np
import pytest

from graphopt.executor.kernels import _compiled, _util, loss, nn, training_ops
from graphopt.executor.kernels._threads import ROW_BLOCK

numba = pytest.importorskip("numba")
jit = _compiled.compiled_kernels(np, np.dtype(np.float32), _compiled.MIN_ELEMENTS)
RNG = np.random.default_rng(23)
FLOAT32_MIN_NORMAL = np.finfo(np.float32).tiny


@pytest.fixture(autouse=True)
def _compiled_kernels_on(monkeypatch):
    monkeypatch.setenv(_compiled.ENV_SWITCH, "1")


def _softmax64(x):
    x = x.astype(np.float64)
    e = np.exp(x - x.max(axis=-1, keepdims=True))
    return e / e.sum(axis=-1, keepdims=True)


def _numpy_path(monkeypatch, fn):
    with monkeypatch.context() as patch:
        patch.setenv(_compiled.ENV_SWITCH, "0")
        return fn()


def test_the_gate_answers_float32_numpy_arrays_from_its_size_on(monkeypatch):
    f32 = np.dtype(np.float32)
    assert _compiled.compiled_kernels(np, f32, _compiled.MIN_ELEMENTS) is jit is not None
    assert _compiled.compiled_kernels(np, f32, _compiled.MIN_ELEMENTS - 1) is None
    for dtype in (np.float64, np.float16):
        assert _compiled.compiled_kernels(np, np.dtype(dtype), 1 << 20) is None
    assert _compiled.compiled_kernels(object(), f32, 1 << 20) is None  # another array module
    assert _compiled.describe().startswith("compiled (numba ")
    monkeypatch.setenv(_compiled.ENV_SWITCH, "0")
    assert _compiled.compiled_kernels(np, f32, 1 << 20) is None
    assert _compiled.describe() == f"NumPy passes ({_compiled.ENV_SWITCH}=0)"


def test_without_numba_the_numpy_passes_run(monkeypatch):
    monkeypatch.setattr(_compiled, "_module", None)
    monkeypatch.setattr(_compiled, "_unavailable", None)
    monkeypatch.setitem(sys.modules, "numba", None)  # import numba raises ImportError
    package = sys.modules[_compiled.__name__.rsplit(".", 1)[0]]
    monkeypatch.delitem(sys.modules, package.__name__ + "._jit_kernels")
    monkeypatch.delattr(package, "_jit_kernels")
    assert _compiled.compiled_kernels(np, np.dtype(np.float32), 1 << 20) is None
    assert _compiled.describe().startswith("NumPy passes: numba could not be imported")
    x = RNG.standard_normal((64, 128)).astype(np.float32)
    np.testing.assert_allclose(nn.softmax_over(np, x, (1,)), _softmax64(x), rtol=1e-6,
                               atol=1e-7)


def _exp_of(x):
    """The compiled exp of each element of x (<= 0) through softmax rows of [x, 0]: the peak
    is 0, the sum 1 + exp(x) rounds to 1 for x < -17, so the row's first element is exp(x)."""
    rows = np.stack([x, np.zeros_like(x)], axis=1)
    out = np.empty_like(rows)
    jit.softmax_rows(rows, out)
    return out[:, 0]


def test_exp_is_within_one_ulp_of_every_normal_result():
    # every float32 in [-87.3, -17] in steps of ~2**-10 relative, and the edges
    x = -np.geomspace(17.0, 87.33, 200_001).astype(np.float32)
    got = _exp_of(x).astype(np.float64)
    want = np.exp(x.astype(np.float64))
    ulps = np.abs(got - want) / np.spacing(want.astype(np.float32)).astype(np.float64)
    assert ulps.max() <= 1.0
    # the rounding trick survived compilation: a folded (y + c) - c would give r = x and
    # errors of whole orders of magnitude, not ulps
    assert ulps.mean() < 0.3


def test_exp_flushes_below_the_normal_range_and_keeps_nan():
    x = np.array([-87.5, -100.0, -1e30, -np.inf], np.float32)
    np.testing.assert_array_equal(_exp_of(x), 0.0)
    assert np.exp(np.float64(-87.33654)) >= FLOAT32_MIN_NORMAL  # the floor is the last normal
    row = np.array([[np.nan, 1.0]], np.float32)
    out = np.empty_like(row)
    jit.softmax_rows(row, out)
    assert np.isnan(out).all()


@pytest.mark.parametrize("shape", [(4096, 7), (2048, 64), (64, 256), (16, 3000)])
@pytest.mark.parametrize("in_place", [False, True])
def test_softmax_rows_match_float64_and_the_numpy_passes(monkeypatch, shape, in_place):
    x = (RNG.standard_normal(shape) * 6).astype(np.float32)
    x[::5, ::3] = -np.inf  # masked scores
    want = _softmax64(x)
    numpy_path = _numpy_path(monkeypatch, lambda: nn.softmax_over(np, x, (1,)))
    source = x.copy()
    got = nn.softmax_over(np, source, (1,), source if in_place else None)
    assert (got is source) == in_place
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-9)
    np.testing.assert_allclose(got, numpy_path, rtol=2e-6, atol=1e-9)
    assert (got[::5, ::3] == 0).all()  # a masked score gets exactly 0
    np.testing.assert_allclose(got.sum(axis=1, dtype=np.float64), 1.0, rtol=2e-6)


def test_softmax_of_non_finite_rows_is_nan_as_numpy_gives():
    x = np.zeros((4, 5000), np.float32)
    x[0, 7] = np.nan
    x[1, 9] = np.inf
    x[2, :] = -np.inf
    x[3, 0] = np.nan  # in the first column, where the peak starts
    with np.errstate(invalid="ignore"):
        want = np.exp(x - x.max(axis=1, keepdims=True))
        want /= want.sum(axis=1, keepdims=True)
    got = nn.softmax_over(np, x, (1,))
    assert np.isnan(want).all() and np.isnan(got).all()


def test_softmax_in_a_transposed_layout_and_across_thread_blocks():
    scores = (RNG.standard_normal((8, 64, 16, 128)) * 4).astype(np.float32)
    x = scores.transpose(0, 2, 1, 3)  # (b, h, s, t) over (b, s, h, t) memory: attention
    assert x.size > 2 * ROW_BLOCK
    want = _softmax64(x)
    got = nn.softmax_over(np, x, (3,), x)  # in place
    assert got is x
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-9)
    # each row the same as on its own
    row = np.empty((1, 128), np.float32)
    again = (RNG.standard_normal((8, 64, 16, 128)) * 4).astype(np.float32)
    whole = nn.softmax_over(np, again, (3,))
    jit.softmax_rows(again[3, 17, 5][None], row)
    np.testing.assert_array_equal(whole[3, 17, 5], row[0])


@pytest.mark.parametrize("donated", [False, True])
def test_softmax_grad_rows_match_float64_and_the_numpy_passes(monkeypatch, donated):
    y = _softmax64(RNG.standard_normal((512, 96)) * 3).astype(np.float32)
    dy = RNG.standard_normal(y.shape).astype(np.float32)
    y64, dy64 = y.astype(np.float64), dy.astype(np.float64)
    want = y64 * (dy64 - (y64 * dy64).sum(axis=1, keepdims=True))
    ctx = _Ctx(dy if donated else None)
    numpy_path = _numpy_path(monkeypatch, lambda: training_ops._softmax_grad(
        _Ctx(None), dy.copy(), y, (1,)))
    given = dy.copy() if donated else dy
    ctx = _Ctx(given if donated else None)
    got = training_ops._softmax_grad(ctx, given, y, (1,))
    assert (got is given) == donated
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(got, numpy_path, rtol=1e-5, atol=1e-7)


class _Ctx:
    """The kernel context's two members the row kernels use: the array module and the buffer
    a kernel may write into (the donated dy)."""

    xp = np

    def __init__(self, donated):
        self.donated = donated

    def out_for(self, shape, dtype, like, **_):
        return like if like is self.donated else None


@pytest.mark.parametrize("width,with_bias", [(64, True), (1024, True), (48, False)])
def test_layer_norm_and_its_gradient_match_float64_and_the_numpy_passes(monkeypatch, width,
                                                                           with_bias):
    x = (RNG.standard_normal((256, width)) * 3 + 5).astype(np.float32)  # centred first
    scale = RNG.standard_normal(width).astype(np.float32)
    bias = RNG.standard_normal(width).astype(np.float32) if with_bias else None
    dy = RNG.standard_normal(x.shape).astype(np.float32)
    f32 = np.dtype(np.float32)

    def forward():
        return nn._layer_norm_rows(np, x, 1, 1e-5, f32, scale, bias)

    def backward(mean, inv):
        return training_ops._layer_norm_grad_rows(np, dy, x, scale, mean, inv, f32)

    y, mean, inv = forward()
    dx, scale_grad, bias_grad = backward(mean, inv)
    ny, nmean, ninv = _numpy_path(monkeypatch, forward)
    ndx, nscale, nbias = _numpy_path(monkeypatch, lambda: backward(nmean, ninv))
    x64, dy64 = x.astype(np.float64), dy.astype(np.float64)
    mean64 = x64.mean(axis=1, keepdims=True)
    inv64 = 1 / np.sqrt(((x64 - mean64) ** 2).mean(axis=1, keepdims=True) + 1e-5)
    xhat = (x64 - mean64) * inv64
    want_y = xhat * scale + (0 if bias is None else bias)
    dxhat = dy64 * scale
    want_dx = inv64 * (dxhat - dxhat.mean(axis=1, keepdims=True)
                       - xhat * (dxhat * xhat).mean(axis=1, keepdims=True))
    for got, numpy_path, want, tol in (
            (y, ny, want_y, 2e-5), (mean, nmean, mean64, 1e-6), (inv, ninv, inv64, 2e-5),
            (dx, ndx, want_dx, 5e-5), (scale_grad, nscale, (dy64 * xhat).sum(axis=0), 5e-5),
            (bias_grad, nbias, dy64.sum(axis=0), 1e-5)):
        assert got.dtype == np.float32
        np.testing.assert_allclose(got, want.reshape(got.shape), rtol=tol, atol=tol)
        np.testing.assert_allclose(got, numpy_path, rtol=tol, atol=tol)


def test_gelu_and_its_gradient_from_the_output_match_the_numpy_passes(monkeypatch):
    x = np.concatenate([(RNG.standard_normal(3 * (1 << 18) + 5) * 4).astype(np.float32),
                        np.array([0.0, -0.0, 1e-40, 2.0 ** -76, 30.0, -30.0, 3e38, -3e38],
                                 np.float32)])
    dy = RNG.standard_normal(x.size).astype(np.float32)
    y = _util.gelu_exact(np, x)
    grad = _util.gelu_exact_grad_from_output(dy, x, y)
    ny = _numpy_path(monkeypatch, lambda: _util.gelu_exact(np, x))
    ngrad = _numpy_path(monkeypatch, lambda: _util.gelu_exact_grad_from_output(dy, x, ny))
    np.testing.assert_allclose(y, ny, rtol=1e-6, atol=1e-7 * np.abs(x).max(initial=1.0))
    np.testing.assert_allclose(grad, ngrad, rtol=0, atol=5e-7 * np.abs(dy).max())
    edge = slice(x.size - 8, None)
    np.testing.assert_array_equal(grad[edge][:4], 0.5 * dy[edge][:4])  # Phi(0) = 0.5
    assert math.isfinite(y[-1]) and y[-1] == 0.0 and y[-2] == np.float32(3e38)
    odd = np.array([np.inf, -np.inf, np.nan] * 2000, np.float32)
    with np.errstate(invalid="ignore"):
        numpy_odd = _numpy_path(monkeypatch, lambda: _util.gelu_exact(np, odd))
        np.testing.assert_array_equal(_util.gelu_exact(np, odd), numpy_odd)


# BiasGelu and BiasGeluGrad_dX compiled: gelu(x + bias) and its gradient without the sum
# written out, bit for bit the compiled GELU of the sum; x of several row blocks (threads), a
# transposed x (a copy), rows of a width that is not a multiple of the vector width
@pytest.mark.parametrize("shape,transposed", [((4, 700, 200), False), ((3, 37), False),
                                              ((64, 96), True)])
def test_bias_gelu_and_its_gradient_are_the_gelu_of_the_sum(monkeypatch, shape, transposed):
    monkeypatch.setattr(_compiled, "MIN_ELEMENTS", 0)  # the small shape too
    x = (RNG.standard_normal(shape) * 4).astype(np.float32)
    if transposed:
        x = np.ascontiguousarray(x.T).T
    bias = RNG.standard_normal(shape[-1]).astype(np.float32)
    dy = RNG.standard_normal(shape).astype(np.float32)
    y = _util.bias_gelu_exact(np, x, bias)
    summed = x + bias
    np.testing.assert_array_equal(y, _util.gelu_exact(np, summed))
    grad = _util.bias_gelu_exact_grad_from_output(dy, x, bias, y)
    np.testing.assert_array_equal(grad, _util.gelu_exact_grad_from_output(dy, summed, y))
    assert y.shape == grad.shape == shape


def test_bias_gelu_takes_its_fused_kernels_only_for_a_bias_along_the_last_axis():
    x = RNG.standard_normal((64, 96)).astype(np.float32)
    for bias in (np.ones((1, 96), np.float32), np.ones(64, np.float32)[:, None],
                 np.ones(96, np.float64)):
        assert _util.bias_gelu_exact(np, x, bias) is None  # the kernel adds, then GELU
        assert _util.bias_gelu_exact_grad_from_output(x, x, bias, x) is None


def _session_of(op_type):
    from onnx import TensorProto, helper  # noqa: PLC0415

    from graphopt.executor import Session  # noqa: PLC0415

    graph = helper.make_graph(
        [helper.make_node(op_type, ["x"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])])
    return Session(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]),
                   device="cpu")


@pytest.mark.parametrize("op_type,loads", [("Softmax", True), ("Relu", False)])
def test_a_numpy_session_loads_the_kernels_its_graph_may_call_at_set_up(monkeypatch, op_type,
                                                                         loads):
    monkeypatch.setattr(_compiled, "_module", None)
    monkeypatch.setattr(_compiled, "_unavailable", None)
    _session_of(op_type)
    assert (_compiled._module is not None) == loads
    monkeypatch.setattr(_compiled, "_module", None)
    monkeypatch.setenv(_compiled.ENV_SWITCH, "0")
    _session_of("Softmax")
    assert _compiled._module is None


@pytest.mark.parametrize("in_place", [False, True])
def test_exp_of_nonpositive_matches_numpy_and_leaves_positive_input_to_it(in_place):
    x = -np.abs(RNG.standard_normal(5000) * 30).astype(np.float32)
    x[::7] = -np.inf
    x[3] = np.nan
    want = np.exp(x.astype(np.float64))
    source = x.copy()
    got = nn.exp_of_nonpositive(np, source, source if in_place else None)
    assert (got is source) == in_place
    normal = want >= FLOAT32_MIN_NORMAL
    np.testing.assert_allclose(got[normal], want[normal], rtol=1.2e-7)
    assert (got[~normal & ~np.isnan(x)] <= FLOAT32_MIN_NORMAL).all() and np.isnan(got[3])
    # one element above 0: every element is NumPy's exp (the kernel's range ends at 0)
    x[10] = 89.5
    with np.errstate(over="ignore"):
        np.testing.assert_array_equal(nn.exp_of_nonpositive(np, x), np.exp(x))


def test_log_softmax_and_the_cross_entropy_gradient_match_float64(monkeypatch):
    scores = (RNG.standard_normal((512, 56)) * 5).astype(np.float32)
    labels = RNG.integers(0, 56, 512)
    x64 = scores.astype(np.float64)
    want = x64 - x64.max(axis=1, keepdims=True)
    want -= np.log(np.exp(want).sum(axis=1, keepdims=True))
    log_prob = nn.log_softmax_over(np, scores, (1,))
    numpy_path = _numpy_path(monkeypatch, lambda: nn.log_softmax_over(np, scores, (1,)))
    np.testing.assert_allclose(log_prob, want, rtol=1e-6, atol=2e-6)
    np.testing.assert_allclose(log_prob, numpy_path, rtol=1e-6, atol=2e-6)
    dy = np.array(1.0, np.float32)
    grad = loss.softmax_cross_entropy_grad(np, dy, log_prob, labels, None, None, "mean",
                                           out=log_prob)
    assert grad is log_prob  # in place, as a donated log_prob is
    want_grad = np.exp(want)
    want_grad[np.arange(512), labels] -= 1
    np.testing.assert_allclose(grad, want_grad / 512, rtol=2e-6, atol=1e-9)


@pytest.mark.parametrize("shape", [(32, 56, 32), (8, 56, 128), (3, 5, 2, 7)])
def test_log_softmax_over_the_class_axis_matches_float64_and_the_numpy_passes(monkeypatch,
                                                                              shape):
    scores = (RNG.standard_normal(shape) * 5).astype(np.float32)
    flat = scores.reshape(shape[0], shape[1], -1)
    flat[0, 2, 1] = -np.inf  # a class masked out
    flat[1, :, 0] = -np.inf  # a position with every class masked: NaN, as in NumPy
    flat[2, 3, 1] = np.nan
    got = _checked_log_softmax(monkeypatch, scores, 1)
    assert got.shape == scores.shape
    assert got.reshape(flat.shape)[0, 2, 1] == -np.inf


def _checked_log_softmax(monkeypatch, scores, axis):
    """log_softmax of ``scores`` over ``axis``, checked against float64 and the NumPy passes
    (NaN where they have it, the rest within float32 rounding); the result."""
    x64 = scores.astype(np.float64)
    with np.errstate(invalid="ignore"):
        want = x64 - x64.max(axis=axis, keepdims=True)
        want -= np.log(np.exp(want).sum(axis=axis, keepdims=True))
        numpy_path = _numpy_path(monkeypatch, lambda: nn.log_softmax_over(np, scores, (axis,)))
        got = nn.log_softmax_over(np, scores, (axis,))
    assert got.dtype == np.float32
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_array_equal(np.isnan(got), np.isnan(numpy_path))
    finite = np.isfinite(want)
    np.testing.assert_allclose(got[finite], want[finite], rtol=1e-6, atol=2e-6)
    np.testing.assert_allclose(got[finite], numpy_path[finite], rtol=1e-6, atol=2e-6)
    return got


# classes innermost in memory: a last axis, and a language model's (N, T, C) logits seen as
# (N, C, T): log_softmax_rows, the result laid out as the scores; the last shape is cut into
# row blocks over threads
@pytest.mark.parametrize("memory_shape,perm,axis", [((512, 56), (0, 1), 1),
                                                    ((8, 128, 56), (0, 2, 1), 1),
                                                    ((4, 9, 7, 33), (0, 1, 3, 2), 2),
                                                    ((4, 700, 200), (0, 2, 1), 1)])
def test_log_softmax_over_classes_innermost_in_memory(monkeypatch, memory_shape, perm, axis):
    memory = (RNG.standard_normal(memory_shape) * 5).astype(np.float32)
    rows = memory.reshape(-1, memory_shape[-1])
    rows[0, 2] = -np.inf  # a class masked out
    rows[1, :] = -np.inf  # a row with every class masked: NaN, as in NumPy
    rows[2, 3] = np.nan
    rows[3, 5] = np.inf  # NaN, as in NumPy (inf - inf)
    scores = memory.transpose(perm)
    got = _checked_log_softmax(monkeypatch, scores, axis)
    assert got.strides == scores.strides
    assert got.transpose(np.argsort(perm)).reshape(rows.shape)[0, 2] == -np.inf


def test_the_exp_of_log_probabilities_takes_their_layout():
    log_prob = -np.abs(RNG.standard_normal((8, 128, 56))).astype(np.float32).transpose(0, 2, 1)
    got = nn.exp_of_nonpositive(np, log_prob)
    assert got.strides == log_prob.strides
    # the compiled exp (that of a contiguous copy, bit for bit), not NumPy's
    np.testing.assert_array_equal(got, nn.exp_of_nonpositive(np, log_prob.copy()))
    np.testing.assert_allclose(got, np.exp(log_prob.astype(np.float64)), rtol=2.4e-7)
    out = np.empty_like(log_prob)
    assert nn.exp_of_nonpositive(np, log_prob, out) is out
    np.testing.assert_array_equal(out, got)


def test_a_numba_that_cannot_compile_here_leaves_the_numpy_passes(monkeypatch):
    def refuse():
        raise RuntimeError("cannot cache function 'softmax_rows': no locator available")

    monkeypatch.setattr(_compiled, "_module", None)
    monkeypatch.setattr(_compiled, "_unavailable", None)
    monkeypatch.setattr(jit, "warm_up", refuse)
    assert _compiled.compiled_kernels(np, np.dtype(np.float32), 1 << 20) is None
    assert _compiled.describe() == ("NumPy passes: numba could not compile here (RuntimeError: "
                                    "cannot cache function 'softmax_rows': no locator "
                                    "available)")


def _gelu_tanh64(x):
    x = x.astype(np.float64)
    return 0.5 * x * (1.0 + np.tanh(_util._TANH_C * (x + _util._TANH_K * x ** 3)))


def _gelu_tanh_grad64(x):
    x = x.astype(np.float64)
    t = np.tanh(_util._TANH_C * (x + _util._TANH_K * x ** 3))
    return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * _util._TANH_C * (1 + 3 * _util._TANH_K * x * x)


def test_gelu_tanh_and_its_gradient_in_one_pass(monkeypatch):
    """FastGelu / Gelu(approximate="tanh") and their gradients: within 3e-7 * (1 + |x|) of
    float64 over the range GELU sees (tanh saturates beyond |x| ~ 5), as close to it as the
    NumPy passes they replace, the same at the edges (NaN, +-inf, 0, underflow)."""
    x = np.concatenate([RNG.standard_normal(40_000).astype(np.float32) * 4,
                        np.linspace(-12, 12, 9_001, dtype=np.float32),
                        np.array([0.0, -0.0, 1e-30, -1e-30, FLOAT32_MIN_NORMAL, 80, -80],
                                 np.float32)])
    dy = RNG.standard_normal(x.size).astype(np.float32)
    fast = _util.gelu_tanh(np, x)
    fast_grad = _util.gelu_tanh_grad_times(np, dy, x)
    slow = _numpy_path(monkeypatch, lambda: _util.gelu_tanh(np, x))
    slow_grad = _numpy_path(monkeypatch, lambda: _util.gelu_tanh_grad_times(np, dy, x))
    bound = 3e-7 * (1 + np.abs(x.astype(np.float64)))
    for got in (fast, fast_grad, slow, slow_grad):
        assert got.dtype == np.float32 and got.shape == x.shape
    assert np.all(np.abs(fast - _gelu_tanh64(x)) <= bound)
    assert np.all(np.abs(slow - _gelu_tanh64(x)) <= bound)
    exact_grad = dy * _gelu_tanh_grad64(x)
    grad_bound = bound * np.maximum(1, np.abs(dy))
    assert np.all(np.abs(fast_grad - exact_grad) <= grad_bound)
    assert np.all(np.abs(slow_grad - exact_grad) <= grad_bound)
    edges = np.array([np.nan, np.inf, -np.inf, 0.0], np.float32)
    padded = np.concatenate([edges, np.zeros(_compiled.MIN_ELEMENTS, np.float32)])
    with np.errstate(invalid="ignore"):
        np.testing.assert_array_equal(_util.gelu_tanh(np, padded)[:4],
                                      _numpy_path(monkeypatch,
                                                  lambda: _util.gelu_tanh(np, padded))[:4])
    assert jit is not None  # the compiled kernels ran above

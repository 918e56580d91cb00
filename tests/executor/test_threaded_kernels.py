"""Large NumPy kernels run in row blocks on several threads (executor/kernels/_threads.py):
the blocks must give exactly what one pass over the whole array gives."""

import numpy as np
import pytest

from graphopt.executor.backend import select_backend
from graphopt.executor.context import KernelContext
from graphopt.executor.kernels import _compiled, _threads
from graphopt.executor.kernels._util import (
    _erf32_block,
    _gelu_block,
    _gelu_grad_block,
    erf,
    gelu_exact,
    gelu_exact_grad,
)
from graphopt.executor.kernels.elementwise import _binary
from graphopt.executor.kernels.nn import _layer_norm_rows, softmax_over
from graphopt.executor.kernels.training_ops import _layer_norm_grad_rows, _softmax_grad

ROWS, COLS = 64, 8192  # 2**19 elements: above the threshold, split in blocks
pytestmark = pytest.mark.skipif(_threads.workers() < 2, reason="one CPU: nothing is split")


def _x(shape=(ROWS, COLS), seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def test_large_arrays_are_split():
    assert _threads.parts_for(ROWS * COLS, ROWS) > 1
    assert _threads.parts_for(1000, 10) == 1


def _softmax64(x, axis):
    e = np.exp(x.astype(np.float64) - x.max(axis=axis, keepdims=True))
    return e / e.sum(axis=axis, keepdims=True)


def test_softmax_blocks_equal_each_row_alone(kernel_path):
    x = _x().reshape(4, 16, COLS)[:, ::-1]  # a strided view
    whole = softmax_over(np, x, (2,))
    np.testing.assert_allclose(whole, _softmax64(x, 2), rtol=2e-6, atol=1e-12)
    for i in range(4):  # a row's bits do not depend on the blocks or threads it fell in
        for j in range(16):
            np.testing.assert_array_equal(whole[i, j], softmax_over(np, x[i, j], (0,)))
    donated = x.copy()
    assert softmax_over(np, donated, (2,), out=donated) is donated
    np.testing.assert_array_equal(donated, whole)


def test_softmax_keeps_a_transposed_layout(kernel_path):
    # attention scores laid out (batch, query, head, key) and read as (batch, head, query, key)
    scores = _x((2, 64, 8, 512)).transpose(0, 2, 1, 3)
    probs = softmax_over(np, scores, (3,))
    assert probs.strides == scores.strides  # no copy into another layout
    np.testing.assert_array_equal(probs, softmax_over(np, np.ascontiguousarray(scores), (3,)))
    np.testing.assert_allclose(probs, _softmax64(scores, 3), rtol=2e-6, atol=1e-12)


@pytest.mark.parametrize(("block", "fn"), [(_erf32_block, erf), (_gelu_block, gelu_exact),
                                          (_gelu_grad_block, gelu_exact_grad)])
def test_erf_and_gelu_blocks_equal_one_pass(block, fn, monkeypatch):
    monkeypatch.setenv(_compiled.ENV_SWITCH, "0")  # the NumPy passes' blocks
    x = _x()
    whole = np.empty(x.size, np.float32)
    block(x.reshape(-1), whole, np.empty(x.size, np.float32), np.empty((2, x.size), np.float32))
    np.testing.assert_array_equal(fn(np, x), whole.reshape(x.shape))


@pytest.mark.parametrize("b_shape", [(ROWS, COLS), (COLS,), (1, COLS), (ROWS, 1), ()])
def test_binary_blocks_equal_one_pass_with_broadcasting(b_shape):
    ctx = KernelContext(select_backend("cpu"), None, False, 0)
    a, b = _x(), _x(b_shape, seed=1)
    for ufunc in (np.add, np.subtract, np.multiply, np.true_divide):
        np.testing.assert_array_equal(_binary(ctx, ufunc, a, b), ufunc(a, b))
        np.testing.assert_array_equal(_binary(ctx, ufunc, b, a), ufunc(b, a))


def test_split_covers_every_row_once_in_pieces():
    seen = []
    _threads.run_split(lambda i, j: seen.extend(range(i, j)), 37, 2)
    assert sorted(seen) == list(range(37))


def test_split_does_not_wait_for_a_busy_pool_thread():
    """The pool thread is held by other work: the caller does every piece itself and
    returns, instead of waiting for the thread to come free."""
    import threading

    _threads.run_split(lambda i, j: None, 4, 2)  # the pool exists
    release = threading.Event()
    blockers = [_threads._pool.submit(release.wait) for _ in range(_threads.workers() - 1)]
    seen, done = [], threading.Event()
    caller = threading.Thread(target=lambda: (_threads.run_split(
        lambda i, j: seen.extend(range(i, j)), 64, 2), done.set()))
    caller.start()
    try:
        assert done.wait(10), "run_split waited for a busy pool thread"
        assert sorted(seen) == list(range(64))
    finally:
        release.set()
        caller.join()
        for blocker in blockers:
            blocker.result()


def test_split_propagates_an_exception():
    def fail_at_row_5(i, j):
        if i <= 5 < j:
            raise ValueError("row 5")

    with pytest.raises(ValueError, match="row 5"):
        _threads.run_split(fail_at_row_5, 40, 2)


def test_split_holds_nothing_once_it_returns():
    """A task the busy pool thread never started stays queued: it must not keep the
    kernel's arrays alive past their last use (memory, and the donation check)."""
    import threading
    import weakref

    _threads.run_split(lambda i, j: None, 4, 2)
    release = threading.Event()
    blockers = [_threads._pool.submit(release.wait) for _ in range(_threads.workers() - 1)]
    try:
        array = np.ones(1000)
        watch = weakref.ref(array)
        _threads.run_split(lambda i, j, a=array: a[i:j].sum(), 64, 2)
        del array
        assert watch() is None, "a queued task still references the kernel's arrays"
    finally:
        release.set()
        for blocker in blockers:
            blocker.result()


@pytest.mark.parametrize("op_type", ["Exp", "Tanh", "Sigmoid", "Neg", "Sqrt"])
def test_unary_blocks_equal_one_pass(op_type):
    from graphopt.executor.plan import PlannedNode
    from graphopt.executor.registry import lookup

    formula = {"Exp": np.exp, "Tanh": np.tanh, "Neg": np.negative,
               "Sqrt": lambda v: np.sqrt(np.abs(v)),
               "Sigmoid": lambda v: 1.0 / (1.0 + np.exp(-v))}[op_type]
    spec = lookup("", op_type, 17)
    assert spec.inplace
    node = PlannedNode(index=0, name="u", op_type=op_type, domain="", opset=17,
                       inputs=("x",), outputs=("y",), attrs={})
    ctx = KernelContext(select_backend("cpu"), None, False, 0)
    x = _x()
    if op_type == "Sqrt":
        x = np.abs(x)
    expected = formula(x)
    np.testing.assert_array_equal(spec.fn(ctx, node, x), expected)
    donated = x.copy()
    ctx.donated = (donated,)
    assert spec.fn(ctx, node, donated) is donated
    np.testing.assert_array_equal(donated, expected)


def test_sum_blocks_equal_adds_in_order():
    from graphopt.executor.kernels.elementwise import sum_
    from graphopt.executor.plan import PlannedNode

    node = PlannedNode(index=0, name="s", op_type="Sum", domain="", opset=13,
                       inputs=("a", "b", "c"), outputs=("y",), attrs={})
    ctx = KernelContext(select_backend("cpu"), None, False, 0)
    a, b, c = _x(), _x(seed=1), _x((COLS,), seed=2)
    expected = (a + b) + c
    np.testing.assert_array_equal(sum_(ctx, node, a, b, c), expected)
    donated = b.copy()
    ctx.donated = (donated,)
    assert sum_(ctx, node, a, donated, c) is donated
    np.testing.assert_array_equal(donated, expected)


def _unsplit(monkeypatch, keep_blocks=False):
    """Kernels from now on on one thread, in one block per call (for a reference); with
    ``keep_blocks``, in the same blocks (a kernel that sums block by block, whose bits then
    depend on the blocks but not on the threads running them)."""
    monkeypatch.setattr(_threads, "_WORKERS", 1)
    if not keep_blocks:
        monkeypatch.setattr(_threads, "ROW_BLOCK", 1 << 40)


def test_softmax_grad_blocks_equal_one_pass(monkeypatch, kernel_path):
    ctx = KernelContext(select_backend("cpu"), None, False, 0)
    y = softmax_over(np, _x().reshape(8, 8, COLS), (2,))
    dy = _x(y.shape, seed=1)
    split = _softmax_grad(ctx, dy, y, (2,))
    want = y.astype(np.float64) * (dy - (dy.astype(np.float64) * y).sum(-1, keepdims=True))
    np.testing.assert_allclose(split, want, rtol=1e-4, atol=1e-9)
    _unsplit(monkeypatch)
    np.testing.assert_array_equal(split, _softmax_grad(ctx, dy, y, (2,)))


def test_layer_norm_and_its_gradient_blocks_equal_one_pass(monkeypatch, kernel_path):
    x, dy = _x((ROWS * 32, 256)), _x((ROWS * 32, 256), seed=1)
    scale, bias = _x((256,), seed=2), _x((256,), seed=3)
    y, mean, inv_std = _layer_norm_rows(np, x, 1, 1e-5, np.dtype(np.float32), scale, bias)
    x64 = x.astype(np.float64)
    centered = x64 - x64.mean(1, keepdims=True)
    xhat = centered / np.sqrt((centered * centered).mean(1, keepdims=True) + 1e-5)
    np.testing.assert_allclose(y, xhat * scale + bias, rtol=1e-4, atol=1e-5)
    grads = _layer_norm_grad_rows(np, dy, x, scale, mean, inv_std, np.dtype(np.float32))
    np.testing.assert_allclose(grads[1], (dy * xhat).sum(0), rtol=1e-4, atol=1e-3)
    np.testing.assert_allclose(grads[2], dy.astype(np.float64).sum(0), rtol=1e-4, atol=1e-3)
    _unsplit(monkeypatch, keep_blocks=kernel_path == "compiled")
    one_pass = _layer_norm_rows(np, x, 1, 1e-5, np.dtype(np.float32), scale, bias)
    for got, want in zip((y, mean, inv_std), one_pass, strict=True):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(grads, _layer_norm_grad_rows(np, dy, x, scale, mean, inv_std,
                                                      np.dtype(np.float32)), strict=True):
        np.testing.assert_array_equal(got, want)

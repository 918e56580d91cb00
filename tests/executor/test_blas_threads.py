"""Small products run on one BLAS thread and larger ones on BLAS's own count
(executor/blas_threads.py): the count seen inside the product, and restored after it."""

import numpy as np
import pytest

from graphopt.executor import blas_threads, gemm

threadpoolctl = pytest.importorskip("threadpoolctl")


def _blas_threads_now() -> int:
    return max(c.get_num_threads() for c in blas_threads._blas_controllers())


@pytest.fixture
def two_blas_threads():
    if not blas_threads._blas_controllers():
        pytest.skip("threadpoolctl finds no BLAS to control")
    with threadpoolctl.threadpool_limits(2, user_api="blas"):
        if _blas_threads_now() < 2:
            pytest.skip("BLAS runs one thread here")
        yield


class _RecordingNumpy:
    """numpy whose matmul records the BLAS thread count it ran under."""

    def __init__(self):
        self.seen = []

    def matmul(self, a, b):
        self.seen.append(_blas_threads_now())
        return np.matmul(a, b)


def _product(m, k, n):
    rng = np.random.default_rng(0)
    return (rng.standard_normal((m, k)).astype(np.float32),
            rng.standard_normal((k, n)).astype(np.float32))


def test_small_product_runs_on_one_thread_and_restores_the_count(two_blas_threads,
                                                                  monkeypatch):
    recorder = _RecordingNumpy()
    monkeypatch.setattr(blas_threads, "_numpy_matmul", recorder.matmul)
    a, b = _product(64, 64, 64)
    np.testing.assert_array_equal(gemm.plain_matmul(np, a, b), a @ b)
    assert recorder.seen == [1]
    assert _blas_threads_now() == 2


def test_large_product_keeps_the_blas_count(two_blas_threads, monkeypatch):
    recorder = _RecordingNumpy()
    monkeypatch.setattr(blas_threads, "_numpy_matmul", recorder.matmul)
    a, b = _product(512, 256, 512)  # 2*M*N*K = 2**27 flops, above SERIAL_FLOPS
    assert 2 * 512 * 256 * 512 >= blas_threads.SERIAL_FLOPS
    np.testing.assert_array_equal(gemm.plain_matmul(np, a, b), a @ b)
    assert recorder.seen == [2]


def test_count_restored_when_the_product_fails(two_blas_threads):
    with pytest.raises(ValueError):
        gemm.plain_matmul(np, np.ones((4, 3), np.float32), np.ones((2, 4), np.float32))
    assert _blas_threads_now() == 2

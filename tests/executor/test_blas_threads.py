"""Small products run on one BLAS thread and larger ones on BLAS's own count
(executor/blas_threads.py): the count seen inside the product, and restored after it. Within
one Session.run the count is switched lazily: lowered once for a run of small products,
raised before a large one, before a caller's hook and at the end of the run."""

import numpy as np
import pytest
from onnx import TensorProto, helper

from graphopt.executor import KernelError, Session, blas_threads, gemm

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


def _chain_model(sizes):
    """x (m, k0) times w0 (k0, k1), times w1 (k1, k2), ...: one MatMul per weight, each
    weight a graph input ``w{i}``; the last product is the output ``y``."""
    nodes, inputs = [], [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, sizes[0]])]
    previous = "x"
    for i, (k, n) in enumerate(zip(sizes, sizes[1:], strict=False)):
        inputs.append(helper.make_tensor_value_info(f"w{i}", TensorProto.FLOAT, [k, n]))
        out = "y" if i == len(sizes) - 2 else f"h{i}"
        nodes.append(helper.make_node("MatMul", [previous, f"w{i}"], [out], name=f"mm{i}"))
        previous = out
    graph = helper.make_graph(nodes, "chain", inputs,
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def _chain_feeds(rows, sizes):
    rng = np.random.default_rng(1)
    feeds = {"x": rng.standard_normal((rows, sizes[0])).astype(np.float32)}
    for i, (k, n) in enumerate(zip(sizes, sizes[1:], strict=False)):
        feeds[f"w{i}"] = (rng.standard_normal((k, n)) / np.sqrt(k)).astype(np.float32)
    return feeds


def _count_switches(monkeypatch) -> list:
    """Every set_num_threads call on a BLAS controller, recorded as its argument."""
    calls = []
    for controller in blas_threads._blas_controllers():
        def counting(count, _set=controller.set_num_threads):
            calls.append(count)
            return _set(count)
        monkeypatch.setattr(controller, "set_num_threads", counting)
    return calls


# 512 rows: (512 x 64) x (64 x 64) products are small, (512 x 256) x (256 x 512) large
SMALL_THEN_LARGE = (64, 64, 64, 256, 512, 64)


def test_one_run_switches_once_per_stretch_of_small_products(two_blas_threads, monkeypatch):
    recorder = _RecordingNumpy()
    monkeypatch.setattr(blas_threads, "_numpy_matmul", recorder.matmul)
    session = Session(_chain_model(SMALL_THEN_LARGE), device="cpu")
    feeds = _chain_feeds(512, SMALL_THEN_LARGE)
    switches = _count_switches(monkeypatch)
    got = session.run(feeds)["y"]
    # three small products on one thread, the large one (2*512*256*512 flops) on two, the
    # last small one on one thread again
    assert 2 * 512 * 256 * 512 >= blas_threads.SERIAL_FLOPS > 2 * 512 * 64 * 256
    assert recorder.seen == [1, 1, 1, 2, 1]
    # per controller: down before the first small product, up before the large one, down
    # before the last, up at the end of the run (switched around each product: 10)
    per_controller = len(blas_threads._blas_controllers())
    assert switches == [count for count in (1, 2, 1, 2) for _ in range(per_controller)]
    assert _blas_threads_now() == 2
    want = feeds["x"]
    for i in range(len(SMALL_THEN_LARGE) - 1):
        want = want @ feeds[f"w{i}"]
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


def test_count_restored_after_a_run_whose_kernel_fails(two_blas_threads, monkeypatch):
    """A small product lowers the count, the next node raises: the count is BLAS's own
    again when the error reaches the caller."""
    recorder = _RecordingNumpy()
    monkeypatch.setattr(blas_threads, "_numpy_matmul", recorder.matmul)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
             helper.make_node("Reshape", ["h", "shape"], ["y"], name="bad_reshape")]
    graph = helper.make_graph(
        nodes, "fails",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [8, 8]),
         helper.make_tensor_value_info("w", TensorProto.FLOAT, [8, 8]),
         helper.make_tensor_value_info("shape", TensorProto.INT64, [1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)],
                              ir_version=10)
    session = Session(model, device="cpu")
    ones = np.ones((8, 8), np.float32)
    with pytest.raises(KernelError, match="bad_reshape"):
        session.run({"x": ones, "w": ones, "shape": np.array([7], np.int64)})
    assert recorder.seen == [1]
    assert _blas_threads_now() == 2
    # and the session runs on as before: lowered for its small product, restored after
    out = session.run({"x": ones, "w": ones, "shape": np.array([64], np.int64)})["y"]
    np.testing.assert_array_equal(out, np.full(64, 8, np.float32))
    assert recorder.seen == [1, 1]
    assert _blas_threads_now() == 2


def test_hooks_see_the_blas_count_of_the_caller(two_blas_threads):
    """on_step and observer are the caller's code: they run with BLAS's own count even
    though the run holds it lowered between its small products."""
    sizes = (64, 64, 64, 64)
    session = Session(_chain_model(sizes), device="cpu")
    seen = []
    session.run(_chain_feeds(16, sizes),
                on_step=lambda step, node, outputs: seen.append(("step", _blas_threads_now())),
                observer=lambda step, name, live: seen.append(("observer", _blas_threads_now())))
    assert seen == [("step", 2), ("observer", 2)] * 3
    assert _blas_threads_now() == 2

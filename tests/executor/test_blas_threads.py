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
def blas_on_two_threads():
    if not blas_threads._blas_controllers():
        pytest.skip("threadpoolctl finds no BLAS to control")
    with threadpoolctl.threadpool_limits(2, user_api="blas"):
        if _blas_threads_now() < 2:
            pytest.skip("BLAS runs one thread here")
        yield


@pytest.fixture
def two_blas_threads(blas_on_two_threads, monkeypatch):
    """Two BLAS threads, every product below SERIAL_FLOPS a small one (no mid-size products,
    which the tests at the end of this file look at)."""
    monkeypatch.setattr(blas_threads, "MID_FLOPS", blas_threads.SERIAL_FLOPS)


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


class _Clock:
    """blas_threads' clock, advanced by the recording matmul: a product's duration is what
    the test says it takes on one thread and on two."""

    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _timed_products(monkeypatch, serial_s, threaded_s):
    """Every product records its BLAS thread count and moves the clock on by the time the
    test gives for that count (``threaded_s``: a list, one entry taken per threaded product,
    the last one repeated)."""
    clock, seen, times = _Clock(), [], list(threaded_s)
    monkeypatch.setattr(blas_threads, "_clock", clock)

    def product(a, b):
        threads = _blas_threads_now()
        seen.append(threads)
        clock.now += serial_s if threads == 1 else (times.pop(0) if len(times) > 1 else times[0])
        return np.matmul(a, b)

    monkeypatch.setattr(blas_threads, "_numpy_matmul", product)
    return seen


# 512 rows of 64 times (64 x 64): 2*512*64*64 flops, a mid-size product; two per run
MID = (64, 64, 64)


def _mid_runs(runs):
    assert blas_threads.MID_FLOPS <= 2 * 512 * 64 * 64 < blas_threads.SERIAL_FLOPS
    session = Session(_chain_model(MID), device="cpu")
    feeds = _chain_feeds(512, MID)
    for _ in range(runs):
        session.run(feeds)


def _learning(runs, then):
    """The thread counts of ``runs`` runs of the two mid-size products: SAMPLES runs on one
    thread, SAMPLES on two, then ``then`` (1 or 2) for both products of every run."""
    samples = blas_threads.SAMPLES
    seen = [1, 1] * samples + [2, 2] * samples
    return (seen + [then, then] * runs)[:2 * runs]


def test_mid_size_products_run_threaded_where_the_runs_are_faster_so(
        blas_on_two_threads, monkeypatch):
    seen = _timed_products(monkeypatch, serial_s=1.0, threaded_s=[0.6])
    _mid_runs(9)
    assert seen == _learning(9, then=2)
    assert _blas_threads_now() == 2


def test_mid_size_products_stay_on_one_thread_where_the_runs_are_slower_threaded(
        blas_on_two_threads, monkeypatch):
    # 1.5x the serial time on two threads: slower, though not a stall
    seen = _timed_products(monkeypatch, serial_s=1.0, threaded_s=[1.5])
    _mid_runs(9)
    assert seen == _learning(9, then=1)
    assert _blas_threads_now() == 2


def test_the_choice_follows_the_fastest_runs_not_the_first(blas_on_two_threads, monkeypatch):
    # the first threaded product waits for BLAS's threads to wake; the next ones are fast
    seen = _timed_products(monkeypatch, serial_s=1.0, threaded_s=[2.5, 0.6])
    _mid_runs(9)
    assert seen == _learning(9, then=2)


def test_each_plan_and_feed_shape_learns_on_its_own(blas_on_two_threads, monkeypatch):
    seen = _timed_products(monkeypatch, serial_s=1.0, threaded_s=[0.6])
    session = Session(_chain_model(MID), device="cpu")
    for _ in range(2 * blas_threads.SAMPLES):
        session.run(_chain_feeds(512, MID))
    del seen[:]
    session.run(_chain_feeds(512, MID))
    session.run(_chain_feeds(520, MID))  # new shapes: on one thread first again
    assert seen == [2, 2, 1, 1]


def test_a_failed_run_is_not_timed(blas_on_two_threads):
    blas = blas_threads.BlasThreads()
    blas.hold("key")
    blas._mid_products = 1  # as a mid-size product would
    blas.release()  # the run raised: run_completed was not called
    assert blas._run_times == {}
    blas.hold("key")
    blas._mid_products = 1
    blas.run_completed()
    blas.release()
    assert blas._run_times["key"][1] == 1


def test_stalled_threaded_products_go_back_to_one_thread_then_try_again(
        blas_on_two_threads, monkeypatch):
    # the first threaded product fast, then every one 4x the serial time (a busy machine)
    seen = _timed_products(monkeypatch, serial_s=1.0, threaded_s=[0.6, 4.0])
    samples, backoff = blas_threads.SAMPLES, blas_threads.BACKOFF_RUNS
    # runs 1-3 serial; run 4: 0.6 then a stall; run 5: two stalls, so runs 6 to 5 + backoff
    # on one thread; then the threaded samples go on
    _mid_runs(samples + 2 + backoff + 1)
    assert seen[:2 * samples] == [1, 1] * samples
    assert seen[2 * samples:2 * samples + 4] == [2, 2, 2, 2]
    assert seen[2 * samples + 4:-2] == [1, 1] * backoff
    assert seen[-2:] == [2, 2]


def test_one_slow_threaded_product_is_not_a_stall(blas_on_two_threads, monkeypatch):
    """The first threaded product after a quiet stretch waits for BLAS's threads to wake."""
    seen = _timed_products(monkeypatch, serial_s=1.0, threaded_s=[0.6, 4.0, 0.6])
    _mid_runs(9)
    assert seen == _learning(9, then=2)


def test_the_times_kept_are_bounded(blas_on_two_threads, monkeypatch):
    """Dynamic shapes make a new mid-size shape and a new run key per batch size: past
    KEPT_SHAPES the times are forgotten (and learnt again), not kept forever."""
    monkeypatch.setattr(blas_threads, "KEPT_SHAPES", 3)
    seen = _timed_products(monkeypatch, serial_s=1.0, threaded_s=[0.6])
    session = Session(_chain_model((64, 64)), device="cpu")
    for rows in (512, 520, 528, 536, 512):
        session.run(_chain_feeds(rows, (64, 64)))
    blas = session._ctx.blas
    assert len(blas._best_serial) <= 3 and len(blas._run_times) <= 3
    assert (((512, 64), (64, 64), np.dtype(np.float32), np.dtype(np.float32))
            in blas._best_serial)  # learnt again after it was forgotten
    assert seen == [1, 1, 1, 1, 1]  # every run key new or still learning: one thread


def test_only_numpys_own_blas_is_switched_when_another_is_loaded(monkeypatch):
    """numba loads SciPy's OpenBLAS beside NumPy's: switching it as well would run none of
    NumPy's products on fewer threads and double the cost of each switch."""
    pytest.importorskip("scipy.linalg.cython_blas")  # SciPy's OpenBLAS, loaded
    from threadpoolctl import ThreadpoolController

    every = [c for c in ThreadpoolController().lib_controllers if c.user_api == "blas"]
    numpy_version = blas_threads._numpy_blas_version()
    if numpy_version is None or len({c.version for c in every}) < 2:
        pytest.skip("NumPy's and SciPy's BLAS cannot be told apart here")
    monkeypatch.setattr(blas_threads, "_controllers", None)
    chosen = blas_threads._blas_controllers()
    assert chosen and all(c.version == numpy_version for c in chosen)
    assert len(chosen) < len(every)

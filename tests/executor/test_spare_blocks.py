"""A NumPy session keeps its large released arrays for later products of the same shape
(executor/host_memory.py SpareBlocks): glibc maps blocks of 32 MiB and more afresh
at every allocation. Only arrays nothing else can see are kept and written again: never a
feed, an initializer, a fetched tensor, a value a hook kept, or the owner of a live view.
The tests lower the size from which arrays count as large, so they stay small."""

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from graphopt.executor import Session, host_memory
from graphopt.executor.host_memory import SpareBlocks

LARGE = 4096  # bytes, for these tests


@pytest.fixture(autouse=True)
def _small_large_bytes(monkeypatch):
    monkeypatch.setattr(host_memory, "LARGE_BYTES", LARGE)
    monkeypatch.delenv(host_memory.ENV, raising=False)  # a caller's setting would turn them off


def _fresh(*shape, dtype=np.float32):
    return np.zeros(shape, dtype)


def test_an_array_only_its_caller_holds_is_kept_and_handed_out_again():
    spares = SpareBlocks()
    array = _fresh(32, 64)  # the caller's one reference, as Session.run holds a released value
    spares.offer(array)
    assert spares.nbytes == 32 * 64 * 4
    taken = spares.take((32, 64), np.float32)
    assert taken is not None and taken.shape == (32, 64) and taken.base is None
    assert spares.nbytes == 0
    assert spares.take((32, 64), np.float32) is None  # handed out once


def test_a_kept_array_is_handed_out_in_another_shape_of_its_size_as_a_view():
    spares = SpareBlocks()
    array = _fresh(32, 64)
    spares.offer(array)
    assert spares.take((32, 64), np.float64) is None  # the dtype must match
    assert spares.take((16, 64), np.float32) is None  # and the size
    view = spares.take((4, 8, 64), np.float32)
    assert view.shape == (4, 8, 64) and view.base.shape == (32, 64)
    assert view.flags.c_contiguous


def test_an_array_anything_else_references_is_not_kept():
    spares = SpareBlocks()
    held = _fresh(32, 64)
    also = held  # a second reference
    spares.offer(held)
    assert spares.nbytes == 0
    for array in (_fresh(8, 8),  # below LARGE_BYTES
                  np.asfortranarray(_fresh(32, 64)),  # not row-major
                  np.frombuffer(bytearray(32 * 64 * 4), np.float32)):  # memory it does not own
        spares.offer(array)
    read_only = _fresh(32, 64)
    read_only.flags.writeable = False
    spares.offer(read_only)
    assert spares.nbytes == 0
    del also
    spares.offer(held)  # now the caller's alone
    assert spares.nbytes == 32 * 64 * 4


def test_a_view_gives_its_owner_only_when_nothing_else_sees_the_owner():
    spares = SpareBlocks()
    owner = _fresh(32, 64)
    view, sibling = owner.T, owner[:, :8]
    del owner
    spares.offer(view)  # the sibling view still reads the owner's memory
    assert spares.nbytes == 0
    del sibling
    spares.offer(view)
    assert spares.nbytes == 32 * 64 * 4
    assert spares.take((32, 64), np.float32).base is None


def test_a_run_keeps_what_it_released_up_to_its_budget_and_drops_what_no_run_took():
    spares = SpareBlocks()
    small, large = _fresh(32, 64), _fresh(64, 64)
    spares.offer(small)
    spares.offer(large)
    del small, large
    spares.end_run(64 * 64 * 4)  # room for one of them
    assert spares.nbytes == 32 * 64 * 4
    kept = spares.take((32, 64), np.float32)  # the first offered fits, then no more
    assert kept is not None and spares.nbytes == 0
    spares.offer(kept)  # taken and released again in the next run: fresh again
    spares.end_run(1 << 30)
    assert spares.nbytes == kept.nbytes
    spares.end_run(1 << 30)  # a run that took nothing and released nothing
    assert spares.nbytes == 0


# --- in a session -------------------------------------------------------------------------

M, K, N = 64, 16, 48  # the product: 12 KiB, "large" here


def _product_then_sum(fetch_product=False):
    """p = x @ w (large), s = ReduceSum(p) (small): p dies at the sum, unwritten by it."""
    w = np.random.default_rng(1).standard_normal((K, N)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "w"], ["p"]),
             helper.make_node("ReduceSum", ["p"], ["s"], keepdims=0)]
    outputs = [helper.make_tensor_value_info("s", TensorProto.FLOAT, None)]
    if fetch_product:
        outputs.append(helper.make_tensor_value_info("p", TensorProto.FLOAT, None))
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["m", K])],
        outputs, [numpy_helper.from_array(w, "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), w


def _feeds(seed, rows=M):
    return {"x": np.random.default_rng(seed).standard_normal((rows, K)).astype(np.float32)}


def _product_addresses(session, feeds, runs):
    """The address of the product's memory at each run, seen by a hook that keeps nothing."""
    addresses = []

    def on_step(index, node, outputs):
        if node.op_type == "MatMul":
            addresses.append(outputs[0].__array_interface__["data"][0])

    for _ in range(runs):
        session.run(feeds, on_step=on_step)
    return addresses


def test_a_later_run_writes_its_product_into_the_array_the_last_run_released():
    model, w = _product_then_sum()
    session = Session(model, device="cpu")
    feeds = _feeds(0)
    addresses = _product_addresses(session, feeds, 3)
    assert addresses[1] == addresses[0] and addresses[2] == addresses[0]
    for seed in (1, 2):  # new values each run, every element rewritten
        feeds = _feeds(seed)
        out = session.run(feeds)["s"]
        np.testing.assert_array_equal(out, (feeds["x"] @ w).sum(dtype=np.float32))


def test_the_product_is_the_same_bits_in_a_spare_as_in_an_array_of_its_own():
    feeds = _feeds(3)
    fetching, _ = _product_then_sum(fetch_product=True)  # fetched: never a spare
    alone = Session(fetching, device="cpu").run(feeds)["p"]
    model, _ = _product_then_sum()
    session = Session(model, device="cpu")
    session.run(feeds)
    products = []
    addresses = _product_addresses(session, feeds, 1)
    session.run(feeds, on_step=lambda i, node, outs: products.append(outs[0].copy())
                if node.op_type == "MatMul" else None)
    assert addresses[0] == _product_addresses(session, feeds, 1)[0]  # a spare each time
    assert products[0].tobytes() == alone.tobytes()


def test_a_fetched_product_is_never_written_by_a_later_run():
    model, w = _product_then_sum(fetch_product=True)
    session = Session(model, device="cpu")
    first = session.run(_feeds(0))["p"]
    kept = first.copy()
    for seed in (1, 2):
        session.run(_feeds(seed))
    np.testing.assert_array_equal(first, kept)


def test_a_value_a_hook_kept_is_never_written_by_a_later_run():
    model, _ = _product_then_sum()
    session = Session(model, device="cpu")
    kept = []
    session.run(_feeds(0), on_step=lambda i, node, outs: kept.append(outs[0])
                if node.op_type == "MatMul" else None)
    copy = kept[0].copy()
    addresses = _product_addresses(session, _feeds(1), 2)
    assert kept[0].__array_interface__["data"][0] not in addresses
    np.testing.assert_array_equal(kept[0], copy)


def test_spares_of_a_shape_no_run_asks_for_any_more_are_let_go():
    model, _ = _product_then_sum()
    session = Session(model, device="cpu")
    session.run(_feeds(0))
    spares = session._ctx.spares
    assert spares.nbytes == M * N * 4
    session.run(_feeds(0, rows=2 * M))  # another batch: the old spare is not taken
    assert spares.nbytes == 2 * M * N * 4  # only this run's product is kept
    session.run(_feeds(0, rows=2))  # a small product: nothing is large
    assert spares.nbytes == 0


# --- every layout the GEMM entry point makes writes the whole spare ------------------------

def _mqa_query_in_heads_order():
    return np.random.default_rng(4).standard_normal((2, 3, 5, 4)).astype(np.float32)


@pytest.mark.parametrize("case", [
    "flat rows",            # (B, M, K) @ (K, N): one GEMM over B*M rows
    "heads folded",         # (B, H, M, K) @ (B, 1, K, N), a row-major: heads into rows
    "heads swapped",        # the same with a laid out (B, M, H, K): result a (B, H, M, N) view
    "batched",              # (B, M, K) @ (B, K, N): numpy's own loop
])
def test_a_spare_full_of_nans_gives_the_same_bits_as_a_fresh_result(case):
    from graphopt.executor.gemm import plain_matmul

    rng = np.random.default_rng(5)
    if case == "flat rows":
        a, b = rng.standard_normal((2, 6, 4)), rng.standard_normal((4, 7))
    elif case == "heads folded":
        a, b = _mqa_query_in_heads_order(), rng.standard_normal((2, 1, 4, 7))
    elif case == "heads swapped":
        a = np.ascontiguousarray(_mqa_query_in_heads_order().swapaxes(1, 2)).swapaxes(1, 2)
        b = rng.standard_normal((2, 1, 4, 7))
    else:
        a, b = rng.standard_normal((3, 6, 4)), rng.standard_normal((3, 4, 7))
    a, b = a.astype(np.float32), b.astype(np.float32)
    asked = []

    def large_out(shape, dtype):
        asked.append(shape)
        return np.full(shape, np.nan, dtype)

    fresh = plain_matmul(np, a, b)
    into_spare = plain_matmul(np, a, b, large_out=large_out)
    assert asked, "the product asked for no spare"
    assert into_spare.shape == fresh.shape and into_spare.strides == fresh.strides
    assert into_spare.tobytes() == fresh.tobytes()
    np.testing.assert_array_equal(into_spare, np.matmul(a, b))


def test_the_mqa_attention_scores_are_written_into_last_runs_scores(monkeypatch):
    # QK^T with one shared K head, its output a transposed view (as the MQA block lays out
    # the query), softmax over it in place, then the product with V: the scores' owner dies
    # at that product and comes back as the next run's scores
    q_t = helper.make_node("Transpose", ["q"], ["q_t"], perm=[0, 2, 1, 3])
    nodes = [q_t,
             helper.make_node("MatMul", ["q_t", "k_t"], ["scores"]),
             helper.make_node("Softmax", ["scores"], ["probs"], axis=-1),
             helper.make_node("MatMul", ["probs", "v"], ["ctx"])]
    b, s, h, d = 2, 8, 4, 4  # scores: 2 x 4 x 8 x 8 floats, 2 KiB ...
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("q", TensorProto.FLOAT, [b, s, h, d]),
         helper.make_tensor_value_info("k_t", TensorProto.FLOAT, [b, 1, d, s]),
         helper.make_tensor_value_info("v", TensorProto.FLOAT, [b, 1, s, d])],
        [helper.make_tensor_value_info("ctx", TensorProto.FLOAT, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    rng = np.random.default_rng(6)
    session = Session(model, device="cpu")
    monkeypatch.setattr(host_memory, "LARGE_BYTES", 2048)  # ... large here
    for _ in range(3):
        feeds = {"q": rng.standard_normal((b, s, h, d)).astype(np.float32),
                 "k_t": rng.standard_normal((b, 1, d, s)).astype(np.float32),
                 "v": rng.standard_normal((b, 1, s, d)).astype(np.float32)}
        addresses = _product_addresses(session, feeds, 1)
        scores = feeds["q"].transpose(0, 2, 1, 3) @ feeds["k_t"]
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        np.testing.assert_allclose(session.run(feeds)["ctx"], probs @ feeds["v"],
                                   rtol=1e-5, atol=1e-6)
        assert session._ctx.spares.nbytes == b * h * s * s * 4
    assert addresses[0] == _product_addresses(session, feeds, 1)[0]


def test_keep_host_memory_off_keeps_no_spares(monkeypatch):
    monkeypatch.setenv(host_memory.ENV, "0")
    model, w = _product_then_sum()
    session = Session(model, device="cpu")
    feeds = _feeds(0)
    for _ in range(2):
        np.testing.assert_array_equal(session.run(feeds)["s"],
                                      (feeds["x"] @ w).sum(dtype=np.float32))
    assert session._ctx.spares is None


def test_a_training_step_with_many_spares_gives_the_bits_of_one_with_none(monkeypatch):
    """The `--example mqa` training step with every intermediate of 64 KiB and more counted
    large: spares are taken and released all through the forward and backward passes, and
    every loss and gradient must be the bits of a session that keeps none, run after run."""
    from graphopt.examples.mqa import MqaConfig, build_mqa_model
    from graphopt.trainer import build

    config = MqaConfig(vocab=56)
    graph = build(build_mqa_model(config), loss="cross_entropy", labels="labels")
    fetches = graph.losses + list(graph.grads.values())
    monkeypatch.setattr(host_memory, "LARGE_BYTES", 64 << 10)
    handed_out = []
    take = SpareBlocks.take

    def counting_take(self, shape, dtype):
        spare = take(self, shape, dtype)
        handed_out.append(spare is not None)
        return spare

    monkeypatch.setattr(SpareBlocks, "take", counting_take)
    with_spares = Session(graph.proto, device="cpu")
    monkeypatch.setenv(host_memory.ENV, "0")
    without = Session(graph.proto, device="cpu")
    assert without._ctx.spares is None
    rng = np.random.default_rng(9)
    kept = []
    for _ in range(3):
        ids = rng.integers(0, config.vocab, (16, config.seq))
        feeds = {"input_ids": ids, "labels": np.roll(ids, -1, axis=1), **graph.initial}
        got = with_spares.run(feeds, fetches)
        kept.append(with_spares._ctx.spares.nbytes)
        want = without.run(feeds, fetches)
        for name in fetches:
            assert got[name].tobytes() == want[name].tobytes(), name
    # kept after each run, and written into again: 40 of 61 asks found one here
    assert kept[-1] > 0 and sum(handed_out) >= 15   # spares were taken all through


# --- a run's outputs given back: Session.recycle --------------------------------------------

def _embedding_gradient_model():
    """GatherGrad as a training graph writes it for an embedding: dx (V x D, large here) is
    zeros except the rows the indices pick, which get dy's rows added."""
    vocab, width = 64, 32  # dx: 8 KiB
    shape = numpy_helper.from_array(np.array([vocab, width], np.int64), "shape")
    node = helper.make_node("GatherGrad", ["shape", "indices", "dy"], ["dx"], axis=0,
                            domain="com.microsoft")
    graph = helper.make_graph(
        [node], "g",
        [helper.make_tensor_value_info("indices", TensorProto.INT64, ["n"]),
         helper.make_tensor_value_info("dy", TensorProto.FLOAT, ["n", width])],
        [helper.make_tensor_value_info("dx", TensorProto.FLOAT, None)], [shape])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("com.microsoft", 1)])
    return model, vocab, width


def _embedding_feeds(seed, vocab, width, n=40):
    rng = np.random.default_rng(seed)
    return {"indices": rng.integers(0, vocab, n),
            "dy": rng.standard_normal((n, width)).astype(np.float32)}


def test_recycled_outputs_are_written_into_by_the_next_run_and_empty_the_dict():
    model, w = _product_then_sum(fetch_product=True)
    session = Session(model, device="cpu")
    outputs = session.run(_feeds(0))
    address = outputs["p"].__array_interface__["data"][0]
    session.recycle(outputs)
    assert outputs == {}
    feeds = _feeds(1)
    again = session.run(feeds)
    assert again["p"].__array_interface__["data"][0] == address
    np.testing.assert_array_equal(again["p"], feeds["x"] @ w)


def test_a_recycled_output_the_caller_still_holds_is_never_written():
    model, _ = _product_then_sum(fetch_product=True)
    session = Session(model, device="cpu")
    outputs = session.run(_feeds(0))
    held = outputs["p"]
    copy = held.copy()
    session.recycle(outputs)
    again = session.run(_feeds(1))
    assert again["p"].__array_interface__["data"][0] != held.__array_interface__["data"][0]
    np.testing.assert_array_equal(held, copy)


def test_an_embedding_gradient_in_a_recycled_array_is_the_bits_of_fresh_zeros():
    model, vocab, width = _embedding_gradient_model()
    session = Session(model, device="cpu")
    fresh_session = Session(model, device="cpu")
    first = session.run(_embedding_feeds(0, vocab, width))
    address = first["dx"].__array_interface__["data"][0]
    first["dx"].fill(np.nan)  # what the memory held must not leak into the next gradient
    session.recycle(first)
    for seed in (1, 2):
        feeds = _embedding_feeds(seed, vocab, width)
        got = session.run(feeds)
        assert got["dx"].__array_interface__["data"][0] == address  # the spare was used
        want = fresh_session.run(feeds)["dx"]
        assert got["dx"].tobytes() == want.tobytes()
        reference = np.zeros((vocab, width), np.float32)
        np.add.at(reference, feeds["indices"], feeds["dy"])
        np.testing.assert_allclose(got["dx"], reference, rtol=1e-6, atol=1e-6)
        session.recycle(got)


# --- what spares hold stays within the run's planned peak -----------------------------------

def test_spares_never_take_the_run_above_its_planned_peak():
    """A large tensor released early (a forward activation) is not kept while a larger one of
    another size is made later (the backward pass's): kept, the two would be held at once,
    above the peak the plan printed and checked."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [64, 48])
    out = helper.make_tensor_value_info("out", TensorProto.FLOAT, [])
    nodes = [helper.make_node("Relu", ["x"], ["a"]),                  # 12 KiB
             helper.make_node("ReduceSum", ["a"], ["s"], keepdims=1),  # a dies here
             helper.make_node("Expand", ["s", "wide"], ["c"]),         # 48 KiB, another size
             helper.make_node("ReduceSum", ["c"], ["out"], keepdims=0)]
    wide = numpy_helper.from_array(np.array([256, 48], np.int64), "wide")
    model = helper.make_model(helper.make_graph(nodes, "g", [x], [out], [wide]),
                              opset_imports=[helper.make_opsetid("", 17)])
    session = Session(model, device="cpu")
    feeds = {"x": np.ones((64, 48), np.float32)}
    held = []
    session.run(feeds, observer=lambda *_: held.append(session._ctx.spares.nbytes))
    assert held[1] == 0 and held[2] == 0   # a's memory went back: c is made after it
    assert session._ctx.spares.nbytes == 0 or max(held) <= 256 * 48 * 4

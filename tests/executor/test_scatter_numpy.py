"""On NumPy, scatter_rows applies wide rows in rounds (faster than ufunc.at for an embedding
gradient) and narrow ones with ufunc.at; either way the bits are ufunc.at's."""

import subprocess
import sys
import textwrap

import numpy as np
import pytest

from graphopt.executor.backend import select_backend
from graphopt.executor.context import KernelContext
from graphopt.executor.kernels import _scatter

UFUNCS = {"add": np.add, "mul": np.multiply, "max": np.maximum, "min": np.minimum}


def _ctx():
    return KernelContext(select_backend("cpu"), None, False, 0)


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64, np.int64])
@pytest.mark.parametrize("reduction", list(UFUNCS))
@pytest.mark.parametrize("rows_out,n,width", [(56, 1024, 256), (5, 2000, 3), (300, 40, 64)])
def test_numpy_scatter_is_bitwise_ufunc_at(dtype, reduction, rows_out, n, width):
    rng = np.random.default_rng(3)
    rows = rng.integers(0, rows_out, size=n)
    updates = (rng.standard_normal((n, width)) * 2).astype(dtype)
    if dtype != np.int64:
        updates[::5] = -0.0  # the sign of a zero sum must match too
    base = (rng.standard_normal((rows_out, width)) * 2).astype(dtype)
    want = base.copy()
    UFUNCS[reduction].at(want, rows, updates)
    got = base.copy()
    _scatter.scatter_rows(_ctx(), got, rows, updates, reduction)
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


def test_rounds_only_where_they_pay():
    # an embedding gradient (1024 tokens x 256 over 56 rows, about 30 rounds): rounds
    assert _scatter._rounds_may_pay(1024, 256, 30)
    # narrow rows, many duplicates (2000 rounds of 3 values): ufunc.at
    assert not _scatter._rounds_may_pay(2000 * 5, 3, 2000)


@pytest.mark.parametrize("reduction", list(UFUNCS))
def test_skewed_rows_keep_ufunc_at_bits(reduction):
    # rounds of very different sizes (one row takes half the updates, many rows one): the
    # accumulator's rows are ordered by update count, each round a prefix of them
    rng = np.random.default_rng(5)
    rows = np.where(rng.random(1024) < 0.5, 7, rng.integers(0, 300, size=1024))
    updates = rng.standard_normal((1024, 512)).astype(np.float32)
    assert _scatter._rounds_may_pay(1024, 512, int(np.bincount(rows).max()))
    base = rng.standard_normal((300, 512)).astype(np.float32)
    want = base.copy()
    UFUNCS[reduction].at(want, rows, updates)
    got = base.copy()
    _scatter.scatter_rows(_ctx(), got, rows, updates, reduction)
    np.testing.assert_array_equal(got.view(np.uint8), want.view(np.uint8))


@pytest.fixture(params=["compiled", "numpy passes"])
def float32_add_path(request, monkeypatch):
    """float32 add scatters run numba's loop of np.add.at when it loads, the rounds or
    ufunc.at otherwise: both must give ufunc.at's bits."""
    from graphopt.executor.kernels import _compiled

    if request.param == "compiled":
        if _compiled.compiled_kernels(np, np.dtype(np.float32), 1 << 20) is None:
            pytest.skip("numba's compiled kernels are not available here")
    else:
        monkeypatch.setenv(_compiled.ENV_SWITCH, "0")
    return request.param


@pytest.mark.parametrize("rows_out,n,width", [(56, 1024, 64), (56, 1024, 256), (5, 4096, 3),
                                              (300, 40, 512)])
def test_float32_add_is_bitwise_add_at_either_way(float32_add_path, rows_out, n, width):
    rng = np.random.default_rng(7)
    rows = rng.integers(0, rows_out, size=n)
    updates = (rng.standard_normal((n, width)) * 3).astype(np.float32)
    updates[::7] = -0.0
    base = rng.standard_normal((rows_out, width)).astype(np.float32)
    want = base.copy()
    np.add.at(want, rows, updates)
    got = base.copy()
    _scatter.scatter_rows(_ctx(), got, rows, updates, "add")
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_float32_add_out_of_range_raises_as_numpy_and_writes_nothing(float32_add_path):
    rows = np.arange(4096, dtype=np.int64) % 56
    rows[3000] = 56
    updates = np.ones((4096, 8), np.float32)
    out = np.zeros((56, 8), np.float32)
    with pytest.raises(IndexError, match="index 56 is out of bounds for axis 0 with size 56"):
        _scatter.scatter_rows(_ctx(), out, rows, updates, "add")
    assert not out.any()


def test_float32_add_of_strided_updates_keeps_add_at_bits(float32_add_path):
    rng = np.random.default_rng(8)
    rows = rng.integers(0, 56, size=2048)
    updates = rng.standard_normal((2048, 128)).astype(np.float32)[:, ::2]  # not contiguous
    base = rng.standard_normal((56, 64)).astype(np.float32)
    want = base.copy()
    np.add.at(want, rows, updates)
    got = base.copy()
    _scatter.scatter_rows(_ctx(), got, rows, updates, "add")
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))


def test_a_graph_whose_only_scatter_add_is_a_scatternd_does_not_load_numba():
    """numba's load (0.3-0.8 s, once per process) is paid for GatherGrad, not for a
    ScatterND: its float32 add takes the compiled loop only where numba is loaded anyway."""
    script = textwrap.dedent("""
        import sys
        import numpy as np
        from onnx import TensorProto, helper
        from graphopt.executor import Session

        node = helper.make_node("ScatterND", ["data", "indices", "updates"], ["y"],
                                reduction="add")
        graph = helper.make_graph(
            [node], "g",
            [helper.make_tensor_value_info("data", TensorProto.FLOAT, [64, 128]),
             helper.make_tensor_value_info("indices", TensorProto.INT64, [4096, 1]),
             helper.make_tensor_value_info("updates", TensorProto.FLOAT, [4096, 128])],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
        rng = np.random.default_rng(0)
        feeds = {"data": np.zeros((64, 128), np.float32),
                 "indices": rng.integers(0, 64, (4096, 1)),
                 "updates": rng.standard_normal((4096, 128)).astype(np.float32)}
        y = Session(model, device="cpu").run(feeds)["y"]
        want = feeds["data"].copy()
        np.add.at(want, feeds["indices"][:, 0], feeds["updates"])
        assert y.tobytes() == want.tobytes()
        print("numba" in sys.modules)
    """)
    done = subprocess.run([sys.executable, "-P", "-c", script], capture_output=True, text=True,
                          timeout=120, check=True)
    assert done.stdout.strip() == "False", done.stdout + done.stderr

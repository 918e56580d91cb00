"""The memory guard bounds what a run allocates, not only what its plan could see.

- Data-dependent sizes: ConstantOfShape, Range, Tile, Expand, OneHot, Pad and NonZero whose
  output size comes from the values fed in are checked when the node runs, before it
  allocates; the run stops there, naming the node, the bytes and the limit.
- ``optimize --check`` estimates its random inputs (and the executor's planned peak) before
  drawing them, and a shape too large for any array is one error line.
- A GRAPHOPT_MEMORY_LIMIT that is not a size is refused where it is read, in one line: it never
  turns the guard off, nor raises OverflowError.

The sizes asked for are a few hundred MiB under a 64 MiB limit: nothing here allocates them.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from support.cli_runs import invoke, one_error_line

from graphopt.errors import GraphoptError
from graphopt.executor import ExecutorError, Session, memory
from graphopt.executor.memory import AllocationLimitError, MemorySettingError, parse_limit

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CLI = [sys.executable, "-P", "-m", "graphopt.cli"]
F, I64, BOOL = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL
LIMIT = "64M"
BIG = 1 << 26  # elements: 256 MiB of float32, four times the limit


def _model(nodes, inputs, outputs, inits=()):
    for node in nodes:  # the node under test is named after its output
        node.name = node.name or ("big" if list(node.output) == ["big"] else "")
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(inits))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model


# ---- data-dependent output sizes, checked when the node runs ---------------------------
def _scalar(name, value, dtype=np.float32):
    return numpy_helper.from_array(np.array(value, dtype), name)


# op -> (the node named "big" and what feeds it, elements it makes for a fed maximum n,
#        the sum of its output for a fed maximum n)
def _data_sized(op: str):
    n = [helper.make_node("ReduceMax", ["x"], ["xmax"], keepdims=1),
         helper.make_node("Cast", ["xmax"], ["n"], to=I64)]  # [max(x)]: a size from the data
    if op == "ConstantOfShape":
        nodes = [*n, helper.make_node("ConstantOfShape", ["n"], ["big"],
                                      value=numpy_helper.from_array(np.ones(1, np.float32)))]
        return nodes, (), lambda k: k, lambda k: k
    if op == "Range":
        nodes = [helper.make_node("ReduceMax", ["x"], ["limit"], keepdims=0),
                 helper.make_node("Range", ["zero", "limit", "one"], ["big"])]
        return nodes, (_scalar("zero", 0), _scalar("one", 1)), lambda k: k, \
            lambda k: k * (k - 1) / 2
    if op == "Tile":  # x [4] tiled max(x) times
        return [*n, helper.make_node("Tile", ["x", "n"], ["big"])], (), lambda k: 4 * k, \
            lambda k: k * (6 + k)
    if op == "Expand":
        return ([*n, helper.make_node("Expand", ["ones", "n"], ["big"])],
                (numpy_helper.from_array(np.ones(1, np.float32), "ones"),),
                lambda k: k, lambda k: k)
    if op == "OneHot":
        nodes = [helper.make_node("ReduceMax", ["x"], ["depth"], keepdims=0),
                 helper.make_node("OneHot", ["hot", "depth", "values"], ["big"])]
        return nodes, (numpy_helper.from_array(np.array([0, 1], np.int64), "hot"),
                       numpy_helper.from_array(np.array([0, 1], np.float32), "values")), \
            lambda k: 2 * k, lambda k: 2
    if op == "Pad":  # x [4] padded with max(x) zeros
        nodes = [*n, helper.make_node("Concat", ["none", "n"], ["pads"], axis=0),
                 helper.make_node("Pad", ["x", "pads"], ["big"])]
        return nodes, (numpy_helper.from_array(np.zeros(1, np.int64), "none"),), \
            lambda k: 4 + k, lambda k: 6 + k
    raise AssertionError(op)


OPS = ["ConstantOfShape", "Range", "Tile", "Expand", "OneHot", "Pad"]


def data_sized_model(op: str) -> onnx.ModelProto:
    """x [4] float -> a node "big" whose output size is max(x) (times a constant) -> sum."""
    nodes, inits, _, _ = _data_sized(op)
    return _model([*nodes, helper.make_node("ReduceSum", ["big"], ["s"], keepdims=0)],
                  [helper.make_tensor_value_info("x", F, [4])],
                  [helper.make_tensor_value_info("s", F, [])], inits)


def _feed(k: int) -> dict:
    return {"x": np.array([1, 2, 3, k], np.float32)}


@pytest.mark.parametrize("op", OPS)
def test_data_dependent_output_size_is_checked_when_the_node_runs(monkeypatch, op):
    monkeypatch.setenv(memory.ENV, LIMIT)
    session = Session(data_sized_model(op), device="cpu", numerics=None)
    _, _, elements, total = _data_sized(op)
    assert session.run(_feed(5))["s"] == pytest.approx(total(5))  # small: runs as before
    ran = []
    with pytest.raises(AllocationLimitError) as info:
        session.run(_feed(BIG), observer=lambda step, name, live: ran.append(name))
    error = info.value
    assert isinstance(error, ExecutorError) and error.nbytes == 4 * elements(BIG)
    message = str(error)
    assert "\n" not in message
    for words in ("'big'", f"({op})", f"{4 * elements(BIG)} bytes", "64.0 MiB",
                  "GRAPHOPT_MEMORY_LIMIT=64M", "nothing more was run",
                  "GRAPHOPT_MEMORY_LIMIT=off"):
        assert words in message, message
    assert "big" not in ran and ran  # the nodes before it ran, it did not, nor any after
    assert session.run(_feed(6))["s"] == pytest.approx(total(6))  # the session still works


def test_data_dependent_nonzero_output_is_checked_when_the_node_runs(monkeypatch):
    """NonZero's output is rank x 8 bytes per true element: 16x a bool input of rank 2."""
    monkeypatch.setenv(memory.ENV, LIMIT)
    model = _model([helper.make_node("NonZero", ["m"], ["big"]),
                    helper.make_node("ReduceSum", ["big"], ["s"], keepdims=0)],
                   [helper.make_tensor_value_info("m", BOOL, [2, "k"])],
                   [helper.make_tensor_value_info("s", I64, [])])
    session = Session(model, device="cpu", numerics=None)
    small = np.array([[True, False, True], [False, True, True]])
    assert session.run({"m": small})["s"] == np.nonzero(small)[0].sum() + np.nonzero(small)[1].sum()
    with pytest.raises(AllocationLimitError, match=r"'big' \(NonZero\) would allocate 128\.0 MiB"):
        session.run({"m": np.ones((2, 1 << 22), bool)})  # 8 MiB in, 128 MiB out


def test_data_dependent_sizes_that_fit_are_not_refused(monkeypatch):
    """The check counts what is live, each buffer once: an 8 MiB input alive with two views of
    it, then 48 MiB of ConstantOfShape, fit a 64 MiB limit (counting every view as its own
    8 MiB would make it 72 MiB)."""
    monkeypatch.setenv(memory.ENV, LIMIT)
    model = _model([helper.make_node("Reshape", ["w", "square"], ["v1"]),
                    helper.make_node("Transpose", ["v1"], ["v2"]),
                    helper.make_node("ReduceMax", ["v2"], ["m"], keepdims=1),
                    helper.make_node("Cast", ["m"], ["mi"], to=I64),
                    helper.make_node("Reshape", ["mi", "one"], ["n"]),
                    helper.make_node("ConstantOfShape", ["n"], ["big"]),
                    helper.make_node("ReduceSum", ["big"], ["s"], keepdims=0),
                    helper.make_node("ReduceSum", ["v2"], ["t"], keepdims=0),
                    helper.make_node("ReduceSum", ["v1"], ["u"], keepdims=0),
                    helper.make_node("ReduceSum", ["w"], ["r"], keepdims=0)],
                   [helper.make_tensor_value_info("w", F, [1 << 21])],
                   [helper.make_tensor_value_info(name, F, []) for name in "stur"],
                   [numpy_helper.from_array(np.array([2048, 1024], np.int64), "square"),
                    numpy_helper.from_array(np.array([1], np.int64), "one")])
    session = Session(model, device="cpu", numerics=None)
    w = np.zeros(1 << 21, np.float32)
    w[7] = 12 << 20  # ConstantOfShape([12 Mi]) float32 zeros: 48 MiB
    out = session.run({"w": w})
    assert out["s"] == 0 and out["t"] == out["u"] == out["r"] == 12 << 20


def test_data_dependent_sizes_run_unchecked_with_the_limit_off(monkeypatch):
    monkeypatch.setenv(memory.ENV, "off")
    session = Session(data_sized_model("Expand"), device="cpu", numerics=None)
    assert session._ctx.memory is None  # no check at all: one attribute test per such node
    assert session.run(_feed(1 << 20))["s"] == 1 << 20


HERE = os.path.dirname(os.path.abspath(__file__))


def test_data_dependent_sizes_do_not_allocate_before_refusing(tmp_path):
    """A fresh process: every op asked for 256+ MiB under a 64 MiB limit; its peak memory
    grows by far less than one such output."""
    script = textwrap.dedent(f"""
        import json, sys
        sys.path[:0] = [{HERE!r}, {os.path.dirname(HERE)!r}]   # the test and tests/support
        import numpy as np
        from graphopt.executor import Session
        from graphopt.executor.memory import AllocationLimitError
        from test_reliability_memory_bounds import OPS, BIG, data_sized_model, _feed

        def hwm():
            with open("/proc/self/status") as status:
                line = next(line for line in status if line.startswith("VmHWM:"))
            return int(line.split()[1]) / 1024

        sessions = {{op: Session(data_sized_model(op), device="cpu", numerics=None)
                    for op in OPS}}
        for session in sessions.values():
            session.run(_feed(5))
        before, refused = hwm(), []
        for op, session in sessions.items():
            try:
                session.run(_feed(BIG))
            except AllocationLimitError:
                refused.append(op)
        print(json.dumps({{"refused": refused, "grew_mib": hwm() - before}}))
    """)
    env = dict(os.environ, GRAPHOPT_MEMORY_LIMIT=LIMIT)
    done = subprocess.run([sys.executable, "-P", "-c", script], capture_output=True,
                          text=True, timeout=120, env=env, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["refused"] == OPS
    assert result["grew_mib"] < 32, result


def _trainable_model_with_a_data_sized_node() -> onnx.ModelProto:
    """loss = sum(x @ w) + sum(ConstantOfShape([max(n)], 0)): n is a column of the data."""
    return _model([helper.make_node("MatMul", ["x", "w"], ["xw"]),
                   helper.make_node("ReduceSum", ["xw"], ["fit"], keepdims=0),
                   helper.make_node("ReduceMax", ["n"], ["nmax"], keepdims=1),
                   helper.make_node("ConstantOfShape", ["nmax"], ["big"]),
                   helper.make_node("ReduceSum", ["big"], ["zero"], keepdims=0),
                   helper.make_node("Add", ["fit", "zero"], ["loss"])],
                  [helper.make_tensor_value_info("x", F, ["b", 4]),
                   helper.make_tensor_value_info("n", I64, ["b"])],
                  [helper.make_tensor_value_info("loss", F, [])],
                  [numpy_helper.from_array(np.ones((4, 1), np.float32), "w")])


def test_run_stops_at_a_data_sized_node_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv(memory.ENV, LIMIT)
    model = tmp_path / "m.onnx"
    onnx.save(_trainable_model_with_a_data_sized_node(), model)
    n = np.full(8, 3, np.int64)
    np.savez(tmp_path / "small.npz", x=np.ones((8, 4), np.float32), n=n)
    n[5] = BIG
    np.savez(tmp_path / "big.npz", x=np.ones((8, 4), np.float32), n=n)
    args = ["run", model, "--loss", "output", "--steps", "1", "--batch-size", "8",
            "--device", "cpu", "-q", "-o", tmp_path / "t.onnx"]
    done = invoke(*args, "--data", tmp_path / "small.npz")
    assert done.exit_code == 0, (done.output, done.exception)
    line = one_error_line(invoke(*args, "--data", tmp_path / "big.npz"),
                          "training step 1 failed", "(ConstantOfShape)", "256.0 MiB",
                          "64.0 MiB", "nothing more was run", "GRAPHOPT_MEMORY_LIMIT")
    assert "Traceback" not in line


# ---- optimize --check: estimated before anything is drawn ------------------------------
def _relu_model(dims) -> onnx.ModelProto:
    return _model([helper.make_node("Relu", ["x"], ["y"])],
                  [helper.make_tensor_value_info("x", F, dims)],
                  [helper.make_tensor_value_info("y", F, dims)])


def _limited_cli(args, cwd, limit=LIMIT):
    """The CLI in a fresh process that cannot take the machine: 3 GiB of address space."""
    def cap():
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
    env = dict(os.environ, GRAPHOPT_MEMORY_LIMIT=limit)
    return subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True, cwd=cwd,
                          timeout=120, preexec_fn=cap, env=env)


def _one_line(done, *contains) -> str:
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 1, (done.returncode, done.stderr[-2000:])
    assert len(lines) == 1 and lines[0].startswith("graphopt: error: --check: "), done.stderr
    for words in contains:
        assert words in lines[0], lines[0]
    return lines[0]


def test_check_refuses_declared_inputs_larger_than_the_limit_before_drawing(tmp_path):
    src = tmp_path / "m.onnx"
    onnx.save(_relu_model([3, 1 << 30]), src)  # a 12 GiB input
    done = _limited_cli(["optimize", src, "-o", tmp_path / "o.onnx", "--check"], tmp_path)
    _one_line(done, "random inputs need 12.0 GiB", "input 'x' [3, 1073741824] float32",
              "64.0 MiB available (GRAPHOPT_MEMORY_LIMIT=64M)", "nothing was run")


def test_check_refuses_a_planned_peak_larger_than_the_limit_before_running(tmp_path):
    """A 3 GiB ConstantOfShape: refused with the executor's estimate, not inside
    onnxruntime's allocator."""
    shape = numpy_helper.from_array(np.array([3, 1 << 28], np.int64), "shape")
    model = _model([helper.make_node("ConstantOfShape", ["shape"], ["c"],
                                     value=numpy_helper.from_array(np.ones(1, np.float32))),
                    helper.make_node("Add", ["x", "c"], ["y"])],
                   [helper.make_tensor_value_info("x", F, [1])],
                   [helper.make_tensor_value_info("y", F, [3, 1 << 28])], [shape])
    src = tmp_path / "m.onnx"
    onnx.save(model, src)
    done = _limited_cli(["optimize", src, "-o", tmp_path / "o.onnx", "--check"], tmp_path)
    _one_line(done, "planned peak memory of 6.0 GiB", "64.0 MiB available", "nothing was run")


@pytest.mark.parametrize("dims", [[1 << 62], [1 << 40, 1 << 40]], ids=["2**62", "overflow"])
@pytest.mark.parametrize("limit", [LIMIT, "off"])
def test_check_with_a_shape_too_large_for_an_array_is_one_line(tmp_path, dims, limit,
                                                               monkeypatch):
    monkeypatch.setenv(memory.ENV, limit)
    src = tmp_path / "m.onnx"
    onnx.save(_relu_model(dims), src)
    line = one_error_line(invoke("optimize", src, "-o", tmp_path / "o.onnx", "--check"),
                          "--check: input 'x' has shape", "too large for any array",
                          "nothing was run")
    assert str(dims) in line


def test_check_still_runs_models_that_fit(tmp_path, monkeypatch):
    monkeypatch.setenv(memory.ENV, LIMIT)
    src = tmp_path / "m.onnx"
    onnx.save(_relu_model([2, 3]), src)
    done = invoke("optimize", src, "-o", tmp_path / "o.onnx", "--check")
    assert done.exit_code == 0, (done.output, done.exception)
    assert "outputs match" in done.output


# ---- GRAPHOPT_MEMORY_LIMIT: a size or off, nothing else --------------------------------
BAD_LIMITS = ["nan", "one gig", "1e400", "inf", "-1G", "-5", "12Q", "1.2.3M", "0x100", "  ",
              "1 G B", "G"]


@pytest.mark.parametrize("text", BAD_LIMITS)
def test_memory_limit_that_is_not_a_size_is_refused_where_it_is_read(monkeypatch, text):
    monkeypatch.setenv(memory.ENV, text)
    with pytest.raises(MemorySettingError) as info:
        memory.available_bytes(None)
    assert isinstance(info.value, GraphoptError) and isinstance(info.value, ExecutorError)
    message = str(info.value)
    assert "\n" not in message and f"GRAPHOPT_MEMORY_LIMIT={text!r} is not a memory size" \
        in message and "off" in message
    with pytest.raises(MemorySettingError):  # the session does not run unguarded
        Session(data_sized_model("Expand"), device="cpu", numerics=None)


@pytest.mark.parametrize("text,expected", [
    ("512M", 512 << 20), ("1.5G", 3 << 29), ("2GiB", 2 << 30), ("64MB", 64 << 20),
    ("1024", 1024), ("100b", 100), (" 8 k ", 8 << 10), ("1T", 1 << 40), (".5K", 512),
    ("off", None), ("OFF", None), ("0", None)])
def test_memory_limit_sizes_that_are_accepted(text, expected):
    assert parse_limit(text) == expected


@pytest.mark.parametrize("command", ["run", "check"])
@pytest.mark.parametrize("text", ["nan", "1e400", "one gig"])
def test_memory_limit_that_is_not_a_size_is_one_cli_line(tmp_path, monkeypatch, command, text):
    monkeypatch.setenv(memory.ENV, text)
    if command == "run":
        model = tmp_path / "m.onnx"
        onnx.save(_trainable_model_with_a_data_sized_node(), model)
        np.savez(tmp_path / "d.npz", x=np.ones((8, 4), np.float32), n=np.full(8, 2, np.int64))
        args = ["run", model, "--data", tmp_path / "d.npz", "--loss", "output", "--steps",
                "1", "--batch-size", "8", "--device", "cpu", "-q", "-o", tmp_path / "t.onnx"]
    else:
        onnx.save(_relu_model([2, 3]), tmp_path / "m.onnx")
        args = ["optimize", tmp_path / "m.onnx", "-o", tmp_path / "o.onnx", "--check"]
    one_error_line(invoke(*args), f"GRAPHOPT_MEMORY_LIMIT={text!r} is not a memory size")


# ---- external weights larger than memory ----------------------------------------------------
def test_external_weights_beyond_memory_are_refused_before_reading(tmp_path):
    """A model whose external tensor declares 1 TiB (a sparse file: no disk used) is refused
    by graphopt run from the extents, in one line, without reading: the process stays small."""
    import resource
    import subprocess
    import sys

    rows = 1 << 26                                  # [2**26, 4096] float32 = 1 TiB
    weight = onnx.TensorProto(name="W", data_type=onnx.TensorProto.FLOAT, dims=[rows, 4096],
                              data_location=onnx.TensorProto.EXTERNAL)
    for key, value in (("location", "w.bin"), ("offset", "0"), ("length", str(rows * 4096 * 4))):
        entry = weight.external_data.add()
        entry.key, entry.value = key, value
    graph = onnx.helper.make_graph(
        [onnx.helper.make_node("MatMul", ["x", "W"], ["h"]),
         onnx.helper.make_node("ReduceSum", ["h"], ["y"], keepdims=0)], "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", rows])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [])],
        initializer=[weight])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, tmp_path / "big.onnx")
    with open(tmp_path / "w.bin", "wb") as f:
        f.truncate(rows * 4096 * 4)
    np.savez(tmp_path / "d.npz", x=np.ones((2, 1), np.float32))

    def limited():
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))

    result = subprocess.run(
        [sys.executable, "-P", "-m", "graphopt.cli", "run", str(tmp_path / "big.onnx"),
         "--data", str(tmp_path / "d.npz"), "--loss", "output", "--steps", "1"],
        capture_output=True, text=True, timeout=120, preexec_fn=limited,
        env={**os.environ, "GRAPHOPT_MEMORY_LIMIT": "1G"})
    assert result.returncode == 1, result.stderr[-600:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "its external weights are 1.0 TiB" in lines[0], result.stderr
    assert "nothing was read" in lines[0]

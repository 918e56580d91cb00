"""Nothing a user owns is destroyed, no file makes graphopt block or read what it should not,
files get the permissions any other tool would give.

Test names carry the number of the promise they pin: 01 no output onto an input or another
output, 02 data files other models use are kept, 03 concurrent saves publish whole pairs, 04
a killed run's temporaries are cleaned up, 05 a symlink swapped in after the checks is not
read, 06 FIFOs and devices are refused, 07 functions' and sparse external data is handled
like any other, 20 file modes are what any other tool gives (the umask; an in-place write
keeps the original's mode)."""
from __future__ import annotations

import os
import re
import shutil
import signal
import stat
import subprocess
import sys
import threading
import time

import numpy as np
import onnx
import pytest
from ir.helpers import FEEDS, save_external, weights_model
from onnx import TensorProto, helper, numpy_helper
from support.cli_runs import invoke, one_error_line
from support.models import run_ort

import graphopt
from graphopt import modelio

CLI = [sys.executable, "-P", "-m", "graphopt.cli"]


def snapshot(folder) -> dict[str, bytes]:
    return {name: open(os.path.join(folder, name), "rb").read()
            for name in sorted(os.listdir(folder))
            if os.path.isfile(os.path.join(folder, name))}


def mlp_external(folder) -> str:
    from support.training_runs import MLP
    return save_external(onnx.load(MLP), folder, "mlp.onnx", "mlp.bin")


def mlp_npz(folder) -> str:
    from support.training_runs import mlp_data, write_npz
    return str(write_npz(os.path.join(folder, "d.npz"), mlp_data()))


# ---- item 1: an output onto the input's own files -------------------------------------
# (a hard-linked data file is refused on load by onnx's checker: a potential hardlink attack)
@pytest.mark.parametrize("spelling", ["plain", "dotdot", "symlink"])
def test_item01_output_onto_external_data_is_refused(tmp_path, spelling):
    src = save_external(weights_model(), tmp_path / "m")
    folder = tmp_path / "m"
    out = {"plain": folder / "w.bin", "dotdot": folder / "sub" / ".." / "w.bin",
           "symlink": folder / "link.bin"}[spelling]
    (folder / "sub").mkdir()
    if spelling == "symlink":
        os.symlink("w.bin", out)
    before = snapshot(folder)
    one_error_line(invoke("optimize", src, "-o", out), "external data file 'w.bin'")
    one_error_line(invoke("optimize", src, "-o", tmp_path / "o.onnx", "--report", out),
                   "external data file 'w.bin'")
    assert snapshot(folder) == before
    assert not (tmp_path / "o.onnx").exists()


def test_item01_report_onto_the_output_is_refused(tmp_path):
    src = save_external(weights_model(), tmp_path / "m")
    out = tmp_path / "o.onnx"
    one_error_line(invoke("optimize", src, "-o", out, "--report", out), "the same file")
    assert not out.exists()
    one_error_line(invoke("optimize", src, "-o", out, "--report", tmp_path / "." / "o.onnx"),
                   "the same file")
    assert os.listdir(tmp_path) == ["m"]


# Two names of one file (a hard link) are one file: comparing paths, even real paths, is not
# enough; the file's identity (device, inode) is.
def test_item01_hard_linked_outputs_are_refused_as_the_same_file(tmp_path):
    a, b = tmp_path / "out" / "a.onnx", tmp_path / "out" / "b.json"
    a.parent.mkdir()
    a.write_bytes(b"the user's file")
    os.link(a, b)
    with pytest.raises(graphopt.GraphoptError, match="b.json: --report and -o are the same"):
        modelio.refuse_same_outputs({"-o": str(a), "--report": str(b)})
    src = save_external(weights_model(), tmp_path / "m")
    one_error_line(invoke("optimize", src, "-o", a, "--report", b), "are the same file")
    model = mlp_external(tmp_path / "mlp")
    run = ["run", model, "--data", mlp_npz(tmp_path), "--loss", "cross_entropy",
           "--batch-size", "4", "--steps", "1", "--device", "cpu", "-q"]
    one_error_line(invoke(*run, "-o", a, "--save-graph", b), "are the same file")
    assert sorted(os.listdir(a.parent)) == ["a.onnx", "b.json"]
    assert a.read_bytes() == b"the user's file" and os.path.samefile(a, b)


def test_item01_output_hard_linked_to_the_input_is_refused(tmp_path):
    src = save_external(weights_model(), tmp_path / "m")
    before = snapshot(tmp_path / "m")
    (tmp_path / "out").mkdir()
    model_link, data_link = tmp_path / "out" / "model.onnx", tmp_path / "out" / "w.bin"
    os.link(src, model_link)
    one_error_line(invoke("optimize", src, "-o", model_link), "would overwrite the input")
    one_error_line(invoke("optimize", src, "-o", tmp_path / "out" / "o.onnx", "--report",
                          model_link), "the --report would overwrite the input model")
    os.unlink(model_link)
    # a data file with a second name: onnx's checker refuses the model (a hardlink attack)
    os.link(tmp_path / "m" / "w.bin", data_link)
    one_error_line(invoke("optimize", src, "-o", data_link), "hard link")
    os.unlink(data_link)
    # and the API's save, when the link appears after the model was loaded
    loaded = graphopt.load(src)
    os.link(tmp_path / "m" / "w.bin", data_link)
    with pytest.raises(graphopt.GraphoptError, match="external data file 'w.bin'"):
        graphopt.save(loaded, str(data_link))
    os.unlink(data_link)
    assert snapshot(tmp_path / "m") == before and os.listdir(tmp_path / "out") == []


def test_item01_run_output_onto_external_data_is_refused(tmp_path):
    src = mlp_external(tmp_path / "m")
    data = mlp_npz(tmp_path)
    before = snapshot(tmp_path / "m")
    base = ["run", src, "--data", data, "--loss", "cross_entropy", "--batch-size", "4",
            "--steps", "1", "--device", "cpu", "-q"]
    for extra in (["-o", tmp_path / "m" / "mlp.bin"],
                  ["-o", tmp_path / "m" / "mlp.bin", "--in-place"],
                  ["--save-graph", tmp_path / "m" / "mlp.bin"],
                  ["-o", tmp_path / "t.onnx", "--save-graph", tmp_path / "t.onnx"]):
        result = invoke(*base, *extra)
        one_error_line(result, "external data file 'mlp.bin'" if "t.onnx" not in str(extra)
                       else "the same file")
    assert snapshot(tmp_path / "m") == before
    assert not (tmp_path / "t.onnx").exists()


def test_item01_api_save_onto_the_models_own_data_file_is_refused(tmp_path):
    src = save_external(weights_model(), tmp_path)
    before = snapshot(tmp_path)
    model = graphopt.load(src)
    with pytest.raises(graphopt.GraphoptError, match="external data file 'w.bin'"):
        graphopt.save(model, str(tmp_path / "w.bin"))
    assert snapshot(tmp_path) == before


# ---- item 2: clean-up deletes only what this run created ------------------------------
def test_item02_data_files_an_earlier_output_copy_uses_are_kept(tmp_path):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    out = str(out_dir / "o.onnx")
    graphopt.optimize_file(save_external(weights_model(seed=0), tmp_path / "a"), out)
    shutil.copy(out, out_dir / "backup.onnx")  # a copy of an earlier output
    expected = run_ort(out, FEEDS)[0]
    graphopt.optimize_file(save_external(weights_model(seed=5), tmp_path / "b"), out)
    np.testing.assert_allclose(run_ort(str(out_dir / "backup.onnx"), FEEDS)[0], expected,
                               rtol=1e-5, atol=1e-5)
    assert not np.allclose(run_ort(out, FEEDS)[0], expected)


def test_item02_data_file_the_input_uses_is_kept(tmp_path):
    # an input whose data file is named like an output's data file in the same folder
    src = save_external(weights_model(seed=3), tmp_path, "m.onnx", "o.onnx.0123456789ab.data")
    before = snapshot(tmp_path)
    graphopt.optimize_file(src, str(tmp_path / "o.onnx"))
    after = snapshot(tmp_path)
    assert {k: after.get(k) for k in before} == before
    np.testing.assert_allclose(run_ort(src, FEEDS)[0], run_ort(str(tmp_path / "o.onnx"), FEEDS)[0],
                               rtol=1e-5, atol=1e-5)


# ---- item 3: concurrent runs to one output ----------------------------------------------
def test_item03_concurrent_saves_publish_model_and_data_together(tmp_path, monkeypatch):
    """A's save pauses right after its model is in place; B saves to the same path then. The
    output must end as one complete pair: B's model with B's data (or A's with A's)."""
    out = str(tmp_path / "o.onnx")
    models = {name: modelio.load(save_external(weights_model(seed=seed), tmp_path / name))
              for name, seed in (("A", 0), ("B", 7))}
    expected = {name: run_ort(weights_model(seed=seed), FEEDS)[0]
                for name, seed in (("A", 0), ("B", 7))}
    real_replace = os.replace
    model_of_a_in_place, b_done = threading.Event(), threading.Event()

    def replace(src, dst, *args, **kwargs):
        real_replace(src, dst, *args, **kwargs)
        if threading.current_thread().name == "A" and os.fspath(dst) == out:
            model_of_a_in_place.set()
            b_done.wait(1.5)  # (a save that holds a lock here is waited for by B instead)

    monkeypatch.setattr(modelio.os, "replace", replace)
    errors = []

    def save(name):
        try:
            modelio.save(models[name], out)
        except BaseException as exc:  # noqa: BLE001 (reported below)
            errors.append(exc)
        finally:
            if name == "B":
                b_done.set()

    a = threading.Thread(target=save, args=("A",), name="A")
    a.start()
    assert model_of_a_in_place.wait(30)
    b = threading.Thread(target=save, args=("B",), name="B")
    b.start()
    a.join(30)
    b.join(30)
    monkeypatch.undo()
    assert not errors, errors
    got = run_ort(out, FEEDS)[0]
    assert any(np.allclose(got, e, rtol=1e-5, atol=1e-5) for e in expected.values())


# ---- item 4: temporary files of killed runs ---------------------------------------------
def _big_external_model(folder) -> str:
    """One MatMul with a 48 MiB weight: its streamed, fsynced copy takes a while."""
    cols = 48 * (1 << 20) // (8 * 4)
    w = numpy_helper.from_array(np.ones((8, cols), np.float32), "W")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"])], "big",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, cols])], initializer=[w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    return save_external(model, folder, "big.onnx", "big.bin")


def _hidden(folder) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.startswith("."))


def test_item04_temporaries_of_a_killed_run_are_removed_by_the_next(tmp_path):
    src = _big_external_model(tmp_path / "src")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    out = out_dir / "o.onnx"
    left = []
    for _ in range(5):  # bounded: stop the run while its temporary file is being written
        proc = subprocess.Popen([*CLI, "optimize", src, "-o", out], stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while proc.poll() is None and time.monotonic() < deadline:
            if _hidden(out_dir):
                proc.send_signal(signal.SIGKILL)
                break
            time.sleep(0.002)
        proc.wait(60)
        left = _hidden(out_dir)
        if left:
            break
    assert left, "no run was caught while writing its temporary file"
    subprocess.run([*CLI, "optimize", src, "-o", out], check=True, capture_output=True,
                   timeout=120)
    assert _hidden(out_dir) == []
    assert out.exists()


def test_item04_old_style_temporaries_are_removed_by_age_only(tmp_path):
    folder = tmp_path
    old = folder / ".o.onnx.data.k2j3h4x9.tmp"        # a killed run of an earlier version
    recent = folder / ".o.onnx.p0q1r2s3.tmp"          # maybe a run going on right now
    foreign = folder / ".notes.tmp"                    # not graphopt's
    for path in (old, recent, foreign):
        path.write_bytes(b"x" * 100)
    two_hours_ago = time.time() - 7200
    os.utime(old, (two_hours_ago, two_hours_ago))
    os.utime(foreign, (two_hours_ago, two_hours_ago))
    onnx.save(weights_model(), folder / "m.onnx")
    graphopt.optimize_file(str(folder / "m.onnx"), str(folder / "o.onnx"))
    assert not old.exists() and recent.exists() and foreign.exists()


# ---- item 5: external data is read from the descriptor that was checked ----------------
def _swap_for_symlink_to_secret(folder, tmp_path) -> bytes:
    size = os.path.getsize(folder / "w.bin")
    secret = np.full(size // 4, 1e6, np.float32).tobytes()
    (tmp_path / "secret.bin").write_bytes(secret)
    os.symlink(tmp_path / "secret.bin", folder / "swap")
    os.replace(folder / "swap", folder / "w.bin")
    return secret


def test_item05_symlink_swapped_in_after_load_is_not_copied(tmp_path):
    src = save_external(weights_model(), tmp_path / "m")
    model = modelio.load(src)
    secret = _swap_for_symlink_to_secret(tmp_path / "m", tmp_path)
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    modelio.save(model, str(out_dir / "o.onnx"))
    for name in os.listdir(out_dir):
        assert secret[:64] not in (out_dir / name).read_bytes(), name
    os.unlink(tmp_path / "m" / "w.bin")  # the output needs nothing of the source folder
    np.testing.assert_allclose(run_ort(str(out_dir / "o.onnx"), FEEDS)[0],
                               run_ort(weights_model(), FEEDS)[0], rtol=1e-5, atol=1e-5)


def test_item05_run_trains_on_the_checked_file_not_a_swapped_one(tmp_path, monkeypatch):
    from graphopt.trainer import runner

    src = mlp_external(tmp_path / "m")
    original = {t.name: numpy_helper.to_array(t) for t in onnx.load(src).graph.initializer}
    real_load = runner.modelio.load
    size = os.path.getsize(tmp_path / "m" / "mlp.bin")
    (tmp_path / "secret.bin").write_bytes(np.full(size // 4, 1e6, np.float32).tobytes())

    def load_then_swap(path, *args, **kwargs):
        loaded = real_load(path, *args, **kwargs)
        os.symlink(tmp_path / "secret.bin", tmp_path / "m" / "swap")
        os.replace(tmp_path / "m" / "swap", tmp_path / "m" / "mlp.bin")
        return loaded

    monkeypatch.setattr(runner.modelio, "load", load_then_swap)
    opts = runner.RunOptions(model=src, data=mlp_npz(tmp_path))
    proto, _, _, source = runner._resolve_source(opts)
    # the weights are read where training reads them: from the descriptors the load checked
    from graphopt.trainer.training_graph import tensor_value
    for tensor in proto.graph.initializer:
        np.testing.assert_array_equal(tensor_value(tensor, source.external),
                                      original[tensor.name])


# ---- item 6: only regular files, sizes from fstat ---------------------------------------
def _limited_run(args, cwd, timeout=60):
    """The CLI in a subprocess that cannot block the test forever nor eat the machine."""
    def limit():
        import resource
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))
    try:
        return subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True,
                              cwd=cwd, timeout=timeout, preexec_fn=limit)
    except subprocess.TimeoutExpired:
        pytest.fail(f"graphopt {args[0]} blocked for {timeout} s")


def _run_args(model, tmp_path):
    return ["run", model, "--data", mlp_npz(tmp_path), "--loss", "output", "--steps", "1",
            "--device", "cpu", "-o", tmp_path / "t.onnx"]


@pytest.mark.parametrize("command,kind", [("optimize", "fifo"), ("run", "fifo"),
                                          ("optimize", "dev_zero")])
def test_item06_fifo_or_device_as_model_is_refused(tmp_path, command, kind):
    model = tmp_path / "model.onnx"
    if kind == "fifo":
        os.mkfifo(model)
    else:
        os.symlink("/dev/zero", model)
    args = (["optimize", model, "-o", tmp_path / "t.onnx"] if command == "optimize"
            else _run_args(model, tmp_path))
    proc = _limited_run(args, tmp_path, timeout=30)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1 and len(lines) == 1, proc.stderr[-500:]
    assert "not a regular file" in lines[0], lines[0]
    assert not (tmp_path / "t.onnx").exists()


def test_item06_fifo_as_external_data_is_refused_on_its_descriptor(tmp_path):
    src = save_external(weights_model(), tmp_path / "m")
    os.unlink(tmp_path / "m" / "w.bin")
    os.mkfifo(tmp_path / "m" / "w.bin")
    proc = _limited_run(["optimize", src, "-o", tmp_path / "o.onnx"], tmp_path, timeout=30)
    assert proc.returncode == 1 and "a FIFO, not a regular file" in proc.stderr, proc.stderr
    assert not (tmp_path / "o.onnx").exists()


# ---- item 7: external data of local functions and sparse initializers -------------------
def _append_external(tensor, folder, location):
    raw = numpy_helper.from_array(numpy_helper.to_array(tensor)).raw_data
    with open(os.path.join(folder, location), "ab") as f:
        offset = f.tell()
        f.write(raw)
    tensor.ClearField("raw_data")
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", str(offset)),
                       ("length", str(len(raw)))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value


def function_and_sparse_model(folder, function_location="f.bin", sparse_location="s.bin"):
    """A local function whose Constant is external data, plus an external sparse initializer."""
    os.makedirs(folder, exist_ok=True)
    value = numpy_helper.from_array(np.arange(8, dtype=np.float32).reshape(2, 4) * 0.5, "c")
    function = helper.make_function(
        "local", "AddC", ["X"], ["Y"],
        [helper.make_node("Constant", [], ["C"], value=value),
         helper.make_node("Add", ["X", "C"], ["Y"])], [helper.make_opsetid("", 17)])
    values = numpy_helper.from_array(np.array([1.0, 2.0, 3.0], np.float32), "S")
    sparse = helper.make_sparse_tensor(
        values, numpy_helper.from_array(np.array([0, 5, 7], np.int64), "S_idx"), [2, 4])
    if function_location:
        _append_external(function.node[0].attribute[0].t, folder, function_location)
    if sparse_location:
        _append_external(sparse.values, folder, sparse_location)
    graph = helper.make_graph(
        [helper.make_node("AddC", ["x"], ["a"], domain="local"),
         helper.make_node("Add", ["a", "S"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 4])],
        sparse_initializer=[sparse])
    model = helper.make_model(graph, functions=[function], opset_imports=[
        helper.make_opsetid("", 17), helper.make_opsetid("local", 1)])
    model.ir_version = 8
    path = os.path.join(folder, "m.onnx")
    onnx.save(model, path)
    return path


def test_item07_function_and_sparse_external_data_is_copied_beside_the_output(
        tmp_path, monkeypatch):
    src = function_and_sparse_model(tmp_path / "m")
    x = {"x": np.zeros((2, 4), np.float32)}
    expected = run_ort(src, x)[0]
    (tmp_path / "out").mkdir()
    monkeypatch.chdir(tmp_path)  # neither the model's folder nor the output's
    out = str(tmp_path / "out" / "o.onnx")
    graphopt.optimize_file(src, out)
    shutil.rmtree(tmp_path / "m")  # the output must not need the source folder
    assert all(not n.endswith(".bin") for n in os.listdir(tmp_path / "out"))
    np.testing.assert_array_equal(run_ort(out, x)[0], expected)


@pytest.mark.parametrize("where", ["function", "sparse"])
def test_item07_function_and_sparse_external_data_escaping_is_refused(tmp_path, where):
    secret = tmp_path / "secret.bin"
    secret.write_bytes(np.zeros(64, np.float32).tobytes())
    src = function_and_sparse_model(
        tmp_path / "m", function_location="f.bin" if where == "sparse" else None,
        sparse_location="s.bin" if where == "function" else None)
    proto = onnx.load(src, load_external_data=False)
    tensor = (proto.functions[0].node[0].attribute[0].t if where == "function"
              else proto.graph.sparse_initializer[0].values)
    tensor.ClearField("float_data")
    tensor.ClearField("raw_data")
    tensor.data_location = TensorProto.EXTERNAL
    for key, value in (("location", "../secret.bin"), ("offset", "0"),
                       ("length", str(8 * 4 if where == "function" else 3 * 4))):
        entry = tensor.external_data.add()
        entry.key, entry.value = key, value
    with open(src, "wb") as f:
        f.write(proto.SerializeToString())
    one_error_line(invoke("optimize", src, "-o", tmp_path / "o.onnx"),
                   "outside the model's folder")
    assert not (tmp_path / "o.onnx").exists()


# ---- item 20: permissions ---------------------------------------------------------------
@pytest.fixture
def umask():
    def set_umask(mask):
        previous.append(os.umask(mask))
    previous: list[int] = []
    yield set_umask
    if previous:
        os.umask(previous[0])


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_item20_new_files_follow_the_umask(tmp_path, umask):
    umask(0o027)
    src = save_external(weights_model(), tmp_path / "m")
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    result = invoke("optimize", src, "-o", out_dir / "o.onnx", "--report", out_dir / "r.json")
    assert result.exit_code == 0, result.output
    modes = {name: _mode(out_dir / name) for name in os.listdir(out_dir)}
    assert len(modes) == 3 and set(modes.values()) == {0o640}, {k: oct(v) for k, v in
                                                              modes.items()}


def test_item20_in_place_keeps_the_original_mode(tmp_path, umask):
    umask(0o077)
    src = tmp_path / "m.onnx"
    onnx.save(weights_model(), src)
    os.chmod(src, 0o644)
    result = invoke("optimize", src, "--in-place")
    assert result.exit_code == 0, result.output
    assert _mode(src) == 0o644
    ext = save_external(weights_model(), tmp_path / "e")
    os.chmod(ext, 0o664)
    assert invoke("optimize", ext, "--in-place").exit_code == 0
    data = [n for n in os.listdir(tmp_path / "e") if re.fullmatch(r"model\.onnx\..*\.data", n)]
    assert _mode(ext) == 0o664 and [_mode(tmp_path / "e" / n) for n in data] == [0o664]



def test_item03_concurrent_saves_in_rounds_never_leave_a_broken_pair(tmp_path):
    """Bounded rounds of two saves started together (threads, in-process: fast); before the
    fix most rounds ended with the model pointing at a data file the other save deleted."""
    out = str(tmp_path / "o.onnx")
    seeds = {"A": 0, "B": 7}
    models = {n: modelio.load(save_external(weights_model(seed=s), tmp_path / n))
              for n, s in seeds.items()}
    weights = {n: numpy_helper.to_array(weights_model(seed=s).graph.initializer[0])
               for n, s in seeds.items()}
    broken = []
    for round_ in range(20):
        barrier = threading.Barrier(2)

        def save(name, barrier=barrier):
            barrier.wait()
            modelio.save(models[name], out)

        threads = [threading.Thread(target=save, args=(n,)) for n in models]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        try:
            got = [numpy_helper.to_array(t) for t in onnx.load(out).graph.initializer
                   if t.name == "W"]
        except Exception as exc:  # noqa: BLE001 (a missing data file: broken)
            broken.append(f"round {round_}: {type(exc).__name__}")
            continue
        if not any(np.array_equal(got[0], w) for w in weights.values()):
            broken.append(f"round {round_}: weights of neither model")
    assert broken == [], broken

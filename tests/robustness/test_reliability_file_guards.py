"""Every output of every command is guarded the same way: it never replaces a file the
command reads (the model, its external data, --data, --eval-data, a resumed checkpoint) or
one it has just written, never writes through a symlink or a hard link into another file,
never blocks on a FIFO, fails on a full disk with one line and the previous file kept and no
temporary left, and takes any valid file name. The weights are written before anything
optional, and what a model names reaches the terminal with its control characters escaped.

Each test is named after the class of failure it pins."""
from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
import sys

import numpy as np
import onnx
import pytest
from ir.helpers import save_external, weights_model
from onnx import TensorProto, helper
from support.cli_runs import invoke, one_error_line

from graphopt import modelio
from graphopt.errors import GraphoptError, Terminated

CLI = [sys.executable, "-P", "-m", "graphopt.cli"]
TRAIN = ("--loss", "cross_entropy", "--steps", "2", "--batch-size", "4", "-q")


def mlp_and_data(folder) -> tuple[str, str, str]:
    from support.training_runs import MLP, mlp_data, write_npz

    model = os.path.join(folder, "mlp.onnx")
    shutil.copy(MLP, model)
    data = write_npz(os.path.join(folder, "d.npz"), mlp_data())
    held_out = write_npz(os.path.join(folder, "e.npz"), mlp_data(8, seed=2))
    return model, data, held_out


def temporaries(folder) -> list[str]:
    return sorted(n for n in os.listdir(folder) if n.endswith(".tmp") or ".tmp-" in n)


# ---- data loss: an output onto a file the command reads ---------------------------------
@pytest.mark.parametrize("option", ["-o", "--denormal-report", "--save-graph"])
@pytest.mark.parametrize("target", ["data", "eval", "data-symlink", "data-hardlink"])
def test_data_loss_outputs_never_replace_the_training_data(tmp_path, option, target):
    model, data, held_out = mlp_and_data(tmp_path)
    path = {"data": data, "eval": held_out, "data-symlink": tmp_path / "link.npz",
            "data-hardlink": tmp_path / "hard.npz"}[target]
    if target == "data-symlink":
        os.symlink("d.npz", path)
    if target == "data-hardlink":
        os.link(data, path)
    before = {p: open(p, "rb").read() for p in (data, held_out)}
    line = one_error_line(invoke("run", model, "--data", data, "--eval-data", held_out,
                                 *TRAIN, option, path), "would overwrite the")
    assert "--eval-data file" in line if target == "eval" else "--data file" in line
    assert {p: open(p, "rb").read() for p in (data, held_out)} == before


@pytest.mark.parametrize("link", [os.symlink, os.link])
def test_data_loss_checkpoint_folder_holding_the_data_is_refused(tmp_path, link):
    model, data, _ = mlp_and_data(tmp_path)
    folder = tmp_path / "ck"
    folder.mkdir()
    link(data, folder / "checkpoint.npz")
    before = open(data, "rb").read()
    one_error_line(invoke("run", model, "--data", data, *TRAIN, "--checkpoint", folder),
                   "--data file")
    assert open(data, "rb").read() == before


def test_data_loss_output_onto_the_resumed_checkpoint_is_refused(tmp_path):
    model, data, _ = mlp_and_data(tmp_path)
    folder = tmp_path / "ck"
    assert invoke("run", model, "--data", data, *TRAIN, "--checkpoint", folder).exit_code == 0
    saved = folder / "checkpoint.npz"
    before = saved.read_bytes()
    one_error_line(invoke("run", model, "--data", data, "--checkpoint", folder, "--resume",
                          "--steps", "4", "-q", "--denormal-report", saved),
                   "checkpoint being resumed")
    assert saved.read_bytes() == before
    # its own next checkpoint may replace it
    assert invoke("run", model, "--data", data, "--checkpoint", folder, "--resume",
                  "--steps", "4", "-q").exit_code == 0


def test_data_loss_report_onto_the_outputs_own_data_file_is_refused(tmp_path):
    src = save_external(weights_model(), tmp_path / "m")
    out = tmp_path / "o.onnx"
    assert invoke("optimize", src, "-o", out, "-q").exit_code == 0
    data_file = next(p for p in tmp_path.iterdir() if p.name.endswith(".data"))
    before = data_file.read_bytes()
    # the same content again: the save reuses the data file, the report must not replace it
    one_error_line(invoke("optimize", src, "-o", out, "-q", "--report", data_file),
                   "optimized model's file")
    assert data_file.read_bytes() == before
    onnx.checker.check_model(str(out), full_check=True)


def test_data_loss_protected_files_are_checked_again_just_before_publishing(tmp_path):
    """A file that became an input's other name after the command's first checks (a hard
    link made while it trained) is still not replaced."""
    victim = tmp_path / "d.npz"
    victim.write_bytes(b"training data")
    protect = modelio.ProtectedFiles()
    protect.add(str(victim), "--data file")
    out = tmp_path / "report.json"
    os.link(victim, out)
    with pytest.raises(GraphoptError, match="would overwrite the --data file"):
        modelio.write_text_atomic(str(out), "{}", "--report", protect=protect)
    assert victim.read_bytes() == b"training data"
    assert temporaries(tmp_path) == []


# ---- writes through links ---------------------------------------------------------------
@pytest.mark.parametrize("link", ["symlink", "hardlink"])
def test_links_log_replaces_its_path_never_the_file_it_points_to(tmp_path, link):
    model, data, _ = mlp_and_data(tmp_path)
    victim = tmp_path / "victim.csv"
    victim.write_text("precious\n")
    log = tmp_path / "log.csv"
    (os.symlink if link == "symlink" else os.link)(victim, log)
    result = invoke("run", model, "--data", data, *TRAIN, "--log", log)
    assert result.exit_code == 0, result.output
    assert victim.read_text() == "precious\n"
    assert not log.is_symlink() and os.stat(log).st_nlink == 1
    assert log.read_text().startswith("step,")


@pytest.mark.parametrize("link", ["symlink", "hardlink"])
def test_links_log_appended_through_a_link_is_copied_not_written_through(tmp_path, link):
    victim = tmp_path / "victim.csv"
    victim.write_text("step,loss\n1,2.0\n")
    log = tmp_path / "log.csv"
    (os.symlink if link == "symlink" else os.link)(victim, log)
    with modelio.open_for_appending(str(log), "--log", append=True) as f:
        f.write("2,1.5\n")
    assert victim.read_text() == "step,loss\n1,2.0\n"
    assert log.read_text() == "step,loss\n1,2.0\n2,1.5\n"
    assert not log.is_symlink() and os.stat(log).st_nlink == 1


def test_links_own_log_is_appended_in_place(tmp_path):
    log = tmp_path / "log.csv"
    log.write_text("step,loss\n")
    inode = os.stat(log).st_ino
    with modelio.open_for_appending(str(log), "--log", append=True) as f:
        f.write("1,2.0\n")
    assert os.stat(log).st_ino == inode and log.read_text() == "step,loss\n1,2.0\n"


@pytest.mark.parametrize("writer", ["plot", "report", "denormal"])
def test_links_planted_temporary_names_cannot_redirect_a_write(tmp_path, writer):
    """Temporaries get unpredictable O_EXCL names: symlinks planted at every name an older
    scheme would have used (``<path>.tmp-<pid>.<ext>``, ``<path>.tmp``) are never followed."""
    pytest.importorskip("matplotlib")
    from graphopt.trainer.export import plot_losses

    victim = tmp_path / "victim"
    victim.write_bytes(b"precious")
    path = tmp_path / ("p.png" if writer == "plot" else "r.json")
    for name in (f"{path.name}.tmp-{os.getpid()}.png", f"{path.name}.tmp",
                 f".{path.name}.tmp"):
        os.symlink(victim, tmp_path / name)
    if writer == "plot":
        plot_losses([{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.0}], str(path), "t")
    else:
        modelio.write_text_atomic(str(path), "{}", f"--{writer}")
    assert victim.read_bytes() == b"precious"
    assert path.is_file() and not path.is_symlink()


# ---- FIFOs and devices -------------------------------------------------------------------
@pytest.mark.parametrize("option", ["--log", "--plot", "-o", "--denormal-report",
                                    "--save-graph"])
def test_fifo_as_a_run_output_is_refused_at_once(tmp_path, option):
    model, data, _ = mlp_and_data(tmp_path)
    name = {"--log": "log.csv", "--plot": "p.png"}.get(option, "out.onnx")
    fifo = tmp_path / name
    os.mkfifo(fifo)
    result = subprocess.run([*CLI, "run", model, "--data", data, *TRAIN, option, fifo],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 1, result.stderr
    assert result.stderr.strip().splitlines() == [
        line for line in result.stderr.strip().splitlines() if "a FIFO" in line], result.stderr
    assert os.path.exists(fifo) and temporaries(tmp_path) == []


@pytest.mark.parametrize("option", ["-o", "--report"])
def test_fifo_as_an_optimize_output_is_refused_at_once(tmp_path, option):
    src = save_external(weights_model(), tmp_path / "m")
    fifo = tmp_path / "out"
    os.mkfifo(fifo)
    args = ["-o", fifo] if option == "-o" else ["-o", tmp_path / "o.onnx", "--report", fifo]
    result = subprocess.run([*CLI, "optimize", src, *map(str, args)], capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 1 and "a FIFO" in result.stderr, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "o.onnx").exists()


@pytest.mark.parametrize("option", ["-o", "--report"])
def test_a_device_as_an_optimize_output_is_refused_at_once(tmp_path, option):
    src = save_external(weights_model(), tmp_path / "m")
    args = ["-o", "/dev/null"] if option == "-o" else \
        ["-o", str(tmp_path / "o.onnx"), "--report", "/dev/null"]
    result = invoke("optimize", src, *args)
    one_error_line(result, "/dev/null")
    assert not (tmp_path / "o.onnx").exists() and os.path.exists("/dev/null")


@pytest.mark.parametrize("option", ["-o", "--report"])
def test_links_optimize_outputs_replace_the_link_never_the_file_it_points_to(tmp_path, option):
    src = save_external(weights_model(), tmp_path / "m")
    victim = tmp_path / "victim.txt"
    victim.write_text("keep me")
    link = tmp_path / ("out.onnx" if option == "-o" else "report.json")
    os.symlink(victim, link)
    args = ["-o", str(link)] if option == "-o" else \
        ["-o", str(tmp_path / "o.onnx"), "--report", str(link)]
    result = invoke("optimize", src, *args)
    assert result.exit_code == 0, result.output
    assert victim.read_text() == "keep me"
    assert not os.path.islink(link) and os.path.getsize(link) > 0


def test_fifo_behind_a_symlink_is_refused(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    os.symlink("fifo", tmp_path / "r.json")
    with pytest.raises(GraphoptError, match="a FIFO .through a symlink."):
        modelio.write_text_atomic(str(tmp_path / "r.json"), "{}", "--report")


# ---- full disks --------------------------------------------------------------------------
@pytest.fixture
def small_disk(tmp_path):
    """A 256 KiB tmpfs (root only: skipped elsewhere)."""
    where = tmp_path / "disk"
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(where)],
                             capture_output=True)
    if mounted.returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], capture_output=True)


def fill(folder) -> None:
    """Fill the disk, leaving nothing free."""
    with contextlib.suppress(OSError), open(os.path.join(folder, "filler"), "wb") as f:
        while True:
            f.write(b"\0" * 4096)
            f.flush()


def test_full_disk_report_is_one_line_and_keeps_the_previous_file(tmp_path, small_disk):
    src = save_external(weights_model(), tmp_path / "m")
    report = small_disk / "r.json"
    report.write_text("previous")
    fill(small_disk)
    one_error_line(invoke("optimize", src, "--dry-run", "-q", "--report", report),
                   "No space left on device")
    assert report.read_text() == "previous"
    assert temporaries(small_disk) == []


def test_full_disk_run_outputs_are_one_line_and_leave_no_temporary(tmp_path, small_disk):
    pytest.importorskip("matplotlib")
    model, data, _ = mlp_and_data(tmp_path)
    plot = small_disk / "p.png"
    plot.write_bytes(b"previous")
    fill(small_disk)
    one_error_line(invoke("run", model, "--data", data, *TRAIN, "--plot", plot),
                   "No space left on device")
    assert plot.read_bytes() == b"previous"
    assert temporaries(small_disk) == []


@pytest.mark.parametrize("resume", [False, True])
def test_full_disk_on_the_log_keeps_the_previous_log(tmp_path, small_disk, resume):
    """A new log replaces the earlier file only while it can be written: on a full disk the
    earlier file comes back; an appended (resumed) log is cut back to its whole records."""
    model, data, _ = mlp_and_data(tmp_path)
    log = small_disk / "log.csv"
    folder = tmp_path / "ckpt"
    if resume:
        run_ok = invoke("run", model, "--data", data, *TRAIN, "--checkpoint", folder,
                        "--log", log)
        assert run_ok.exit_code == 0, run_ok.output
    else:
        log.write_text("PREVIOUS LOG\n" * 10)
    before = log.read_bytes()
    fill(small_disk)
    # resumed: enough steps to outgrow the room the log's last page has left
    extra = ("--checkpoint", folder, "--resume", "--steps", "400") if resume else ()
    one_error_line(invoke("run", model, "--data", data, *TRAIN, *extra, "--log", log),
                   "--log", "No space left on device")
    after = log.read_bytes()
    if resume:
        assert after.startswith(before) and after.endswith(b"\n")
        rows = after.decode().splitlines()
        assert {len(row.split(",")) for row in rows} == {len(rows[0].split(","))}
    else:
        assert after == before
    assert [n for n in os.listdir(small_disk) if n not in ("log.csv", "filler")] == []


def test_full_disk_on_the_checkpoint_lock_names_the_lock_file(tmp_path, small_disk):
    model, data, _ = mlp_and_data(tmp_path)
    folder = small_disk / "ckpt"
    first = invoke("run", model, "--data", data, *TRAIN, "--checkpoint", folder)
    assert first.exit_code == 0, first.output
    saved = (folder / "checkpoint.npz").read_bytes()
    fill(small_disk)
    one_error_line(invoke("run", model, "--data", data, *TRAIN, "--checkpoint", folder,
                          "--resume", "--steps", "40"),
                   "cannot write the lock file", str(folder), "No space left on device")
    assert (folder / "checkpoint.npz").read_bytes() == saved


def test_full_disk_on_the_trained_model_keeps_the_previous_one(tmp_path, small_disk):
    model, data, _ = mlp_and_data(tmp_path)
    out = small_disk / "t.onnx"
    out.write_bytes(b"previous")
    fill(small_disk)
    one_error_line(invoke("run", model, "--data", data, *TRAIN, "-o", out), "t.onnx")
    assert out.read_bytes() == b"previous"
    assert temporaries(small_disk) == []


@pytest.mark.parametrize("command", [["rules"], ["optimize", "{src}", "--dry-run", "-q",
                                                 "--report", "-"]])
def test_full_disk_standard_output_is_one_line(tmp_path, command):
    src = save_external(weights_model(), tmp_path / "m")
    with open("/dev/full", "w") as full:
        result = subprocess.run([*CLI, *[c.format(src=src) for c in command]], stdout=full,
                                stderr=subprocess.PIPE, text=True, timeout=120)
    assert result.returncode == 1, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("graphopt: error: "), result.stderr
    assert "No space left on device" in lines[0]


def test_full_disk_error_inside_the_block_removes_the_temporary(tmp_path):
    target = tmp_path / "r.json"
    target.write_text("previous")
    with pytest.raises(GraphoptError, match="cannot write the --report: No space left"), \
            modelio.atomic_file(str(target), "--report") as f:
        f.write(b"partial")
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    assert target.read_text() == "previous" and temporaries(tmp_path) == []


# ---- long names ----------------------------------------------------------------------------
def test_long_names_up_to_name_max_are_written(tmp_path):
    src = save_external(weights_model(), tmp_path / "m")
    out = tmp_path / ("o" * 245 + ".onnx")          # 250 bytes: valid (NAME_MAX is 255)
    result = invoke("optimize", src, "-o", out, "-q", "--report",
                    tmp_path / ("r" * 245 + ".json"))
    assert result.exit_code == 0, result.output
    onnx.checker.check_model(str(out), full_check=True)
    assert all(len(name.encode()) <= 255 for name in os.listdir(tmp_path))
    assert temporaries(tmp_path) == []


def test_long_names_of_run_outputs_are_written(tmp_path):
    model, data, _ = mlp_and_data(tmp_path)
    out = tmp_path / ("t" * 240 + ".onnx")
    log = tmp_path / ("l" * 240 + ".csv")
    result = invoke("run", model, "--data", data, *TRAIN, "-o", out, "--log", log)
    assert result.exit_code == 0, result.output
    onnx.checker.check_model(str(out))
    assert log.read_text().startswith("step,")


# ---- the weights before anything optional -------------------------------------------------
def test_terminated_during_the_plot_keeps_the_trained_weights(tmp_path, monkeypatch):
    """SIGTERM while the end-of-run plot is written (simulated: the signal handler raises
    Terminated inside savefig): the trained model is already written, no temporary is left,
    exit 143."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    model, data, _ = mlp_and_data(tmp_path)

    def terminated(self, *args, **kwargs):
        target = args[0]
        target.write(b"half a png")
        raise Terminated

    monkeypatch.setattr(Figure, "savefig", terminated)
    out, plot = tmp_path / "t.onnx", tmp_path / "p.png"
    result = invoke("run", model, "--data", data, *TRAIN, "-o", out, "--plot", plot)
    assert result.exit_code == 143, (result.output, result.exception)
    onnx.checker.check_model(str(out))
    assert not plot.exists() and temporaries(tmp_path) == []


# ---- control characters in messages --------------------------------------------------------
HOSTILE = "x\ninjected line\x1b[31m\u202e"


def hostile_name_model(folder) -> str:
    graph = helper.make_graph([helper.make_node("Relu", [HOSTILE], ["y"])], "g",
                              [helper.make_tensor_value_info(HOSTILE, TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = os.path.join(folder, "hostile.onnx")
    onnx.save(model, path)
    return path


def test_control_characters_in_names_are_escaped_in_errors(tmp_path):
    path = hostile_name_model(tmp_path)
    line = one_error_line(invoke("optimize", path, "--dry-run", "--input-shape", "nope:1"),
                          "no input 'nope'")
    assert "\x1b" not in line and "\u202e" not in line
    assert "x\\ninjected line\\x1b[31m\\u202e" in line


def test_control_characters_in_what_the_user_typed_are_escaped(tmp_path):
    path = hostile_name_model(tmp_path)
    result = invoke("optimize", path, "--dry-run", "--input-shape", "a\x1b]0;title\x07:1")
    line = one_error_line(result)
    assert "\x1b" not in result.stderr and "\x07" not in result.stderr
    assert "\\x1b]0;title\\x07" in line


def test_control_characters_in_tables_are_escaped_and_lines_kept(tmp_path):
    path = hostile_name_model(tmp_path)
    result = invoke("optimize", path, "--dry-run", "-v")
    assert result.exit_code == 0, result.output
    assert "\x1b" not in result.output and "\u202e" not in result.output
    assert len(result.output.splitlines()) > 3


def test_control_characters_printable_escapes_as_repr_does():
    from graphopt.console import printable

    assert printable("a\nb\x1b\x7f\x9b\u200b") == "a\\nb\\x1b\\x7f\\x9b\\u200b"
    assert printable("a\nb\x1b", keep_newlines=True) == "a\nb\\x1b"
    assert printable("plain: naïve 名前") == "plain: naïve 名前"


def test_names_arrays_round_trip_unchanged_by_escaping(tmp_path):
    """Escaping is for the terminal only: the files keep the names as they are."""
    path = hostile_name_model(tmp_path)
    out = tmp_path / "o.onnx"
    assert invoke("optimize", path, "-o", out, "-q").exit_code == 0
    assert onnx.load(str(out)).graph.input[0].name == HOSTILE
    np.testing.assert_equal(len(onnx.load(str(out)).graph.node), 1)

"""Checkpoints and the training state they keep: where a Ctrl-C saves without --checkpoint, what
is read or replaced (regular files only), what a checkpoint may cost to read, which saved
settings are accepted, and what a full disk or SIGTERM during a save leaves behind.

Each test is named after the failure class it pins and failed on the code before its fix
(the disk-full and SIGTERM ones pin behaviour that already held)."""
from __future__ import annotations

import errno
import io
import os
import re
import signal
import subprocess
import sys
import textwrap
import zipfile

import numpy as np
import onnx
import pytest
from support.cli_runs import assert_one_error_line, cli
from support.training_runs import edited_checkpoint

from graphopt.errors import GraphoptError
from graphopt.trainer import checkpoint as ckpt
from graphopt.trainer import loop

HERE = os.path.dirname(os.path.abspath(__file__))
MLP = os.path.join(HERE, os.pardir, "fixtures", "mlp.onnx")
CLI = [sys.executable, "-P", "-m", "graphopt.cli"]
TRAIN = ["--loss", "cross_entropy", "--batch-size", "4", "--device", "cpu", "--seed", "5"]


def subprocess_cli(*args, timeout: float = 30, cwd=None) -> subprocess.CompletedProcess:
    try:
        return subprocess.run([*CLI, *map(str, args)], capture_output=True, text=True,
                              timeout=timeout, cwd=cwd)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"graphopt {' '.join(map(str, args))} still ran after "
                             f"{timeout} s") from None


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> str:
    rng = np.random.default_rng(1)
    path = tmp_path_factory.mktemp("data") / "data.npz"
    np.savez(path, x=rng.standard_normal((40, 64)).astype(np.float32),
             labels=rng.integers(0, 10, 40).astype(np.int64))
    return str(path)


@pytest.fixture(scope="module")
def good_checkpoint(tmp_path_factory, data) -> str:
    folder = str(tmp_path_factory.mktemp("good") / "ckpt")
    code, _, stderr = cli("run", MLP, "--data", data, "--steps", 3, "--lr", 0.01,
                          "--checkpoint", folder, "-q", *TRAIN)
    assert code == 0, stderr
    return folder


def interrupt_after(monkeypatch, step: int) -> None:
    """One Ctrl-C (SIGINT to this process) during step ``step``: the run finishes the step,
    checkpoints and exits 130."""
    real = loop.Trainer.train_step

    def train_step(self):
        record = real(self)
        if self.step == step:
            os.kill(os.getpid(), signal.SIGINT)
        return record

    monkeypatch.setattr(loop.Trainer, "train_step", train_step)


def sigmoid_mlp(folder) -> str:
    """Another model with the MLP's weights: Sigmoid where the MLP has Relu."""
    model = onnx.load(MLP)
    for node in model.graph.node:
        if node.op_type == "Relu":
            node.op_type = "Sigmoid"
    path = os.path.join(folder, "sigmoid_mlp.onnx")
    onnx.save(model, path)
    return path


RESUME = re.compile(r"continue with --checkpoint (\S+) --resume")


def interrupted_run(model: str, data: str, step: int) -> str:
    """A run without --checkpoint (in the current folder) interrupted after ``step``: the
    folder its message says to resume from."""
    with pytest.MonkeyPatch.context() as patch:
        interrupt_after(patch, step)
        code, stdout, stderr = cli("run", model, "--data", data, "--steps", 20, "-q", *TRAIN)
    assert code == 130, (code, stdout, stderr)
    found = RESUME.search(stdout)
    assert found, stdout
    return found.group(1)


# -- Ctrl-C without --checkpoint: one folder per run ----------------------------------------
def test_ctrl_c_of_another_run_keeps_the_first_runs_interrupt_checkpoint(tmp_path, data,
                                                                        monkeypatch):
    work = tmp_path / "work"
    work.mkdir()
    other = sigmoid_mlp(str(tmp_path))
    monkeypatch.chdir(work)
    first = interrupted_run(MLP, data, 2)
    second = interrupted_run(other, data, 3)
    assert first != second
    assert os.path.basename(first).startswith("mlp-")
    assert os.path.basename(second).startswith("sigmoid_mlp-")
    for folder in (first, second):
        assert os.path.dirname(os.path.normpath(folder)) == "graphopt-checkpoint"
    assert ckpt.load(first).step == 2 and ckpt.load(second).step == 3
    # a later Ctrl-C of the same run replaces its own checkpoint, nobody else's
    again = interrupted_run(MLP, data, 4)
    assert again == first and ckpt.load(first).step == 4 and ckpt.load(second).step == 3
    assert len(os.listdir("graphopt-checkpoint")) == 2
    # and the printed instructions resume it
    code, _, stderr = cli("run", MLP, "--data", data, "--checkpoint", first, "--resume",
                          "--steps", 6, "--device", "cpu", "-q")
    assert code == 0, stderr
    assert ckpt.load(first).step == 6


def test_ctrl_c_never_replaces_the_checkpoint_of_a_run_using_that_folder(tmp_path, data,
                                                                        monkeypatch):
    monkeypatch.chdir(tmp_path)
    first = interrupted_run(MLP, data, 2)
    lock = ckpt.FolderLock.acquire(first)   # as a run resumed with --checkpoint FIRST does
    try:
        second = interrupted_run(MLP, data, 3)
    finally:
        lock.release()
    assert second != first and ckpt.load(first).step == 2 and ckpt.load(second).step == 3


def test_the_up_front_warning_names_the_folder_a_ctrl_c_saves_in(tmp_path, data, monkeypatch):
    monkeypatch.chdir(tmp_path)
    code, stdout, stderr = cli("run", MLP, "--data", data, "--steps", 1, *TRAIN)
    assert code == 0, stderr
    warning = stdout.splitlines()[0]
    assert warning.startswith("warning: the trained weights will not be saved")
    assert "./graphopt-checkpoint/mlp-" in warning, warning


# -- only regular files are read or replaced ------------------------------------------------
@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_fifo_as_the_checkpoint_file_is_refused_at_once(tmp_path, data):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    fifo = ckpt.path_in(str(folder))
    os.mkfifo(fifo)
    for extra in (["--resume"], []):
        proc = subprocess_cli("run", MLP, "--data", data, "--steps", 2, "--checkpoint", folder,
                              "-q", *TRAIN, *extra, timeout=20)
        assert_one_error_line(proc.returncode, proc.stderr, fifo, "FIFO", "not a regular file")
        assert os.path.exists(fifo) and not os.path.isfile(fifo)   # still the FIFO


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_fifo_as_the_lock_file_is_refused_in_one_line(tmp_path, data):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    os.mkfifo(folder / ckpt.LOCK_NAME)
    code, _, stderr = cli("run", MLP, "--data", data, "--steps", 2, "--checkpoint", folder,
                          "-q", *TRAIN)
    assert_one_error_line(code, stderr, ckpt.LOCK_NAME, "FIFO", "not a regular file")


# -- a checkpoint is checked from its headers before anything is decompressed --------------
def _npy_header(dtype: str, shape: tuple) -> bytes:
    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(buffer, {"descr": dtype, "fortran_order": False,
                                                  "shape": shape})
    return buffer.getvalue()


def _write_zeros_member(zf: zipfile.ZipFile, name: str, header: bytes, nbytes: int) -> None:
    chunk = bytes(16 << 20)
    info = zipfile.ZipInfo(name)
    info.compress_type = zipfile.ZIP_DEFLATED
    with zf.open(info, "w", force_zip64=True) as member:
        member.write(header)
        while nbytes:
            part = min(nbytes, len(chunk))
            member.write(chunk[:part])
            nbytes -= part


def crafted_checkpoint(good: str, target: str, huge: dict[str, int]) -> str:
    """The good checkpoint with the members in ``huge`` replaced by deflated zeros declaring
    that many float32 values each (a few MB on disk, as many GB as they declare)."""
    os.makedirs(target)
    with zipfile.ZipFile(ckpt.path_in(good)) as source, \
            zipfile.ZipFile(ckpt.path_in(target), "w") as zf:
        for info in source.infolist():
            key = info.filename[:-len(".npy")]
            if key in huge:
                count = huge[key]
                _write_zeros_member(zf, info.filename, _npy_header("<f4", (count,)), count * 4)
            else:
                zf.writestr(info, source.read(info))
    return target


RSS_WRAPPER = textwrap.dedent("""
    import resource, subprocess, sys
    proc = subprocess.run(sys.argv[1:], capture_output=True, text=True)
    sys.stdout.write(f"{resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}\\n")
    sys.stdout.write(f"{proc.returncode}\\n{proc.stderr}")
""")


@pytest.mark.skipif(sys.platform != "linux", reason="ru_maxrss in KiB")
def test_resume_reads_array_headers_before_decompressing_anything(tmp_path, good_checkpoint,
                                                                  data):
    count = 128 << 20   # 512 MiB of float32 in each of two members, ~1 MB each on disk
    folder = crafted_checkpoint(good_checkpoint, str(tmp_path / "ckpt"),
                                {"param/fc1.weight": count, "opt/fc1.weight/exp_avg": count})
    assert os.path.getsize(ckpt.path_in(folder)) < 8 << 20
    proc = subprocess.run([sys.executable, "-c", RSS_WRAPPER, *CLI, "run", MLP, "--data", data,
                           "--steps", "6", "--checkpoint", folder, "--resume", "--device",
                           "cpu", "-q"], capture_output=True, text=True, timeout=120)
    rss_kib, code, stderr = proc.stdout.split("\n", 2)
    assert_one_error_line(int(code), stderr, ckpt.path_in(folder), "fc1.weight")
    assert int(rss_kib) < 700 * 1024, f"resume peaked at {int(rss_kib) >> 10} MiB"


def test_a_member_whose_size_disagrees_with_its_header_is_refused(tmp_path, good_checkpoint):
    folder = str(tmp_path / "ckpt")
    os.makedirs(folder)
    with zipfile.ZipFile(ckpt.path_in(good_checkpoint)) as source, \
            zipfile.ZipFile(ckpt.path_in(folder), "w") as zf:
        for info in source.infolist():
            body = source.read(info)
            if info.filename == "param/fc2.bias.npy":
                body += bytes(4096)   # more bytes than the header's shape holds
            zf.writestr(info, body)
    with pytest.raises(GraphoptError, match=r"checkpoint\.npz: .*fc2\.bias.* holds 4096 bytes "
                                            r"more than its header"):
        ckpt.load(folder)


# -- every saved setting is checked by type and range --------------------------------------
def _setting(key, value):
    def edit(meta):
        meta["settings"][key] = value
    return edit


TAMPERED_SETTINGS = {
    "batch_size a string": ("batch_size", "4"),
    "batch_size true": ("batch_size", True),
    "batch_size zero": ("batch_size", 0),
    "lr a string": ("lr", "0.01"),
    "lr NaN": ("lr", float("nan")),
    "lr negative": ("lr", -1.0),
    "ignore_index a string": ("ignore_index", "-100"),
    "ignore_index a float": ("ignore_index", 1.5),
    "steps a string": ("steps", "3"),
    "steps zero": ("steps", 0),
    "labels a list": ("labels", ["labels"]),
    "loss a number": ("loss", 7),
    "seed a string": ("seed", "5"),
    "seed out of range": ("seed", 2**40),
    "freeze a string": ("freeze", "fc1.weight"),
    "train holding a number": ("train", [1]),
    "optimizer a number": ("optimizer", 5),
    "precision unknown": ("precision", "fp8"),
    "loss_scale a number": ("loss_scale", 1.0),
    "weight_decay a string": ("weight_decay", "0"),
    "lr_schedule a list": ("lr_schedule", ["cosine"]),
    "warmup negative": ("warmup", -1),
    "clip_grad_norm a string": ("clip_grad_norm", "1"),
    "clip_grad_norm infinite": ("clip_grad_norm", float("inf")),
}


@pytest.mark.parametrize("edit", list(TAMPERED_SETTINGS))
def test_tampered_checkpoint_settings_are_one_line_naming_the_field(tmp_path, good_checkpoint,
                                                                    data, edit):
    key, value = TAMPERED_SETTINGS[edit]
    folder = edited_checkpoint(good_checkpoint, str(tmp_path / "ckpt"), _setting(key, value))
    code, _, stderr = cli("run", MLP, "--data", data, "--checkpoint", folder, "--resume",
                          "--device", "cpu", "-q")
    assert_one_error_line(code, stderr, ckpt.path_in(folder), f"settings {key}")


def test_settings_that_are_not_an_object_are_one_line(tmp_path, good_checkpoint, data):
    folder = edited_checkpoint(good_checkpoint, str(tmp_path / "ckpt"),
                               lambda meta: meta.update(settings=["lr", 1]))
    code, _, stderr = cli("run", MLP, "--data", data, "--checkpoint", folder, "--resume",
                          "--device", "cpu", "-q")
    assert_one_error_line(code, stderr, ckpt.path_in(folder), "settings")


@pytest.mark.parametrize("key", ["eval_loss", "grad_norm", "lr"])
def test_tampered_optional_history_values_are_one_line(tmp_path, good_checkpoint, data, key):
    folder = edited_checkpoint(good_checkpoint, str(tmp_path / "ckpt"),
                               lambda meta: meta["history"][1].update({key: "x"}))
    code, _, stderr = cli("run", MLP, "--data", data, "--checkpoint", folder, "--resume",
                          "--steps", 4, "--device", "cpu", "-q")
    assert_one_error_line(code, stderr, ckpt.path_in(folder), f"history record 2: {key}")


# -- a full disk or SIGTERM during a save: the previous checkpoint, no temporary ------------
def _is_temporary(path) -> bool:
    return os.path.basename(str(path)).startswith(ckpt.TEMP_PREFIX)


def _fd_is_temporary(fd: int) -> bool:
    try:
        return _is_temporary(os.readlink(f"/proc/self/fd/{fd}"))
    except OSError:
        return False


ENOSPC = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.skipif(sys.platform != "linux", reason="names descriptors through /proc")
@pytest.mark.parametrize("point", ["write", "fsync", "replace"])
def test_disk_full_at_any_point_of_a_save_keeps_the_previous_checkpoint(tmp_path, data,
                                                                        monkeypatch, point):
    folder = tmp_path / "ckpt"
    saves = []
    real_write, real_fsync, real_replace = ckpt._write_archive, os.fsync, os.replace

    def write(f, arrays):
        saves.append(1)
        if point == "write" and len(saves) == 2:
            f.write(b"PK\x03\x04 half an archive")
            raise ENOSPC
        return real_write(f, arrays)

    def fsync(fd):
        if point == "fsync" and len(saves) == 2 and _fd_is_temporary(fd):
            raise ENOSPC
        return real_fsync(fd)

    def replace(src, dst, *args, **kwargs):
        if point == "replace" and len(saves) == 2 and _is_temporary(src):
            raise ENOSPC
        return real_replace(src, dst, *args, **kwargs)

    monkeypatch.setattr(ckpt, "_write_archive", write)
    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    code, _, stderr = cli("run", MLP, "--data", data, "--steps", 6, "--checkpoint", folder,
                          "--checkpoint-every", 2, "-q", *TRAIN)
    monkeypatch.undo()
    assert_one_error_line(code, stderr, "could not save the checkpoint of step 4",
                   "No space left on device (ENOSPC)",
                   f"the previous checkpoint {ckpt.path_in(str(folder))} (step 2) is intact")
    assert sorted(os.listdir(folder)) == [ckpt.FILENAME]
    assert ckpt.load(str(folder)).step == 2


@pytest.fixture
def tiny_file_system(tmp_path):
    """A 64 KiB tmpfs (room for one MLP checkpoint, not for its next one beside it)."""
    mount = tmp_path / "tiny"
    mount.mkdir()
    if not sys.platform.startswith("linux") or os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root on Linux")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)],
                          capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], capture_output=True)


def test_disk_full_on_a_real_tiny_file_system_keeps_the_previous_checkpoint(tiny_file_system,
                                                                           data):
    folder = tiny_file_system / "ckpt"
    code, _, stderr = cli("run", MLP, "--data", data, "--steps", 6, "--checkpoint", folder,
                          "--checkpoint-every", 2, "-q", *TRAIN)
    assert_one_error_line(code, stderr, "could not save the checkpoint of step 4",
                   f"the previous checkpoint {ckpt.path_in(str(folder))} (step 2) is intact")
    assert sorted(os.listdir(folder)) == [ckpt.FILENAME]
    assert ckpt.load(str(folder)).step == 2


SIGTERM_WRAPPER = textwrap.dedent("""
    import os, signal, sys
    from graphopt.trainer import checkpoint as ck, loop
    nth, stop_at, calls = int(sys.argv[1]), int(sys.argv[2]), []
    real_step = loop.Trainer.train_step
    def train_step(self):   # one SIGTERM during step stop_at: stop there and save
        record = real_step(self)
        if self.step == stop_at:
            os.kill(os.getpid(), signal.SIGTERM)
        return record
    loop.Trainer.train_step = train_step
    real = ck._write_archive
    def write_archive(f, arrays):   # SIGTERM twice in the middle of the nth save
        calls.append(1)
        if len(calls) == nth:
            f.write(b"PK\\x03\\x04 part of an archive")
            os.kill(os.getpid(), signal.SIGTERM)
            os.kill(os.getpid(), signal.SIGTERM)
        real(f, arrays)
    ck._write_archive = write_archive
    from graphopt.cli import main
    main(sys.argv[3:], prog_name="graphopt")
""")


@pytest.mark.skipif(os.name != "posix", reason="needs POSIX signals")
@pytest.mark.parametrize("where", ["--checkpoint", "interrupt folder"])
def test_sigterm_during_a_save_leaves_no_temporary(tmp_path, data, where):
    args = ["run", MLP, "--data", data, "--steps", 6, "-q", *TRAIN]
    if where == "--checkpoint":
        args += ["--checkpoint", tmp_path / "ckpt", "--checkpoint-every", 2]
        nth, stop_at = 2, 0   # the save of step 4, with that of step 2 in place
    else:
        nth, stop_at = 1, 2   # the interrupted run's one save, after a SIGTERM at step 2
    proc = subprocess.run([sys.executable, "-P", "-c", SIGTERM_WRAPPER, str(nth), str(stop_at),
                           *map(str, args)], capture_output=True, text=True, timeout=60,
                          cwd=tmp_path)
    assert proc.returncode == 143 and "Traceback" not in proc.stderr, proc.stderr
    left = [os.path.join(root, name) for root, _, names in os.walk(tmp_path) for name in names
            if _is_temporary(name) or name == ckpt.LOCK_NAME]
    assert left == []
    if where == "--checkpoint":
        assert ckpt.load(str(tmp_path / "ckpt")).step == 2


def test_metadata_declaring_more_text_than_a_checkpoint_holds_is_refused_unread(tmp_path,
                                                                                good_checkpoint,
                                                                                data):
    """A __meta__ member of 128 MiB of text and a little more (zeros: a few hundred KiB
    compressed) is refused from its header, before it is decompressed."""
    folder = tmp_path / "bomb"
    folder.mkdir()
    chars = (ckpt.MAX_META_BYTES >> 2) + 1
    with zipfile.ZipFile(ckpt.path_in(good_checkpoint)) as good, \
            zipfile.ZipFile(ckpt.path_in(str(folder)), "w", zipfile.ZIP_DEFLATED) as bomb:
        for info in good.infolist():
            if info.filename != "__meta__.npy":
                bomb.writestr(info.filename, good.read(info))
        with bomb.open("__meta__.npy", "w", force_zip64=True) as member:
            np.lib.format.write_array_header_1_0(
                member, {"descr": f"<U{chars}", "fortran_order": False, "shape": ()})
            zeros = bytes(1 << 20)
            for _ in range(chars * 4 // len(zeros)):
                member.write(zeros)
            member.write(bytes(chars * 4 % len(zeros)))
    code, _, stderr = cli("run", MLP, "--data", data, "--steps", 4, "--checkpoint", folder,
                          "--resume", "-q", *TRAIN)
    assert_one_error_line(code, stderr, "not a valid checkpoint", "the metadata declares 128 MiB",
                          "more than save() writes")


def test_a_clip_norm_a_checkpoint_could_not_hold_is_refused_up_front(tmp_path, data):
    code, _, stderr = cli("run", MLP, "--data", data, "--steps", 2, "--clip-grad-norm", "inf",
                          "--checkpoint", tmp_path / "ckpt", "-q", *TRAIN)
    assert_one_error_line(code, stderr, "--clip-grad-norm must be a finite number > 0, not inf")
    assert not (tmp_path / "ckpt").exists()

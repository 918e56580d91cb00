"""The exit codes the README promises: a Ctrl-C'd `graphopt run` exits 130 (after saving
where it got to), as does any interrupt inside a command; running out of memory is a
user-facing error (one line, exit 1), as is every other GraphoptError."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from click.testing import CliRunner

from graphopt import api
from graphopt.cli import main
from graphopt.console import INTERRUPTED
from graphopt.errors import GraphoptError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MLP = os.path.join(ROOT, "tests", "fixtures", "mlp.onnx")


@pytest.mark.skipif(os.name != "posix", reason="needs POSIX signals")
def test_an_interrupted_run_exits_130_and_says_where_it_stopped(tmp_path):
    rng = np.random.default_rng(0)
    data = tmp_path / "d.npz"
    np.savez(data, x=rng.standard_normal((40, 64)).astype(np.float32),
             labels=rng.integers(0, 10, 40).astype(np.int64))
    log = tmp_path / "steps.jsonl"
    env = {**os.environ}
    proc = subprocess.Popen(
        [sys.executable, "-P", "-m", "graphopt", "run", MLP, "--data", str(data), "--loss",
         "cross_entropy", "--steps", "1000000", "--batch-size", "4", "--optimizer", "sgd",
         "--lr", "0.01", "--device", "cpu", "--log", str(log), "--checkpoint",
         str(tmp_path / "ck"), "--checkpoint-every", "1000000"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not (log.exists() and log.read_text().count("\n") >= 2):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no training step was logged in time"
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=240)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 130, (out, err)
    assert "interrupted after step" in out + err
    assert "Traceback" not in err
    assert os.path.isfile(tmp_path / "ck" / "checkpoint.npz")


@pytest.mark.parametrize("raised, code, message", [
    (MemoryError(), 1, "graphopt: error: out of memory"),
    (GraphoptError("the model is bad"), 1, "graphopt: error: the model is bad"),
    (KeyboardInterrupt(), 130, INTERRUPTED),  # a Ctrl-C inside a command's body
])
def test_out_of_memory_and_user_errors_exit_1_with_one_line(tmp_path, monkeypatch, raised, code,
                                                             message):
    def fail(*args, **kwargs):
        raise raised

    monkeypatch.setattr(api, "optimize_file", fail)
    result = CliRunner().invoke(main, ["optimize", MLP, "-o", str(tmp_path / "out.onnx")])
    assert result.exit_code == code
    assert result.stderr.strip() == message
    assert not os.path.exists(tmp_path / "out.onnx")

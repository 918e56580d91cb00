"""`graphopt run` through the console script: bad input is one line and exit 1, never a
traceback; a good run prints the rewrites, the FP16 policy and plain progress lines."""
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import onnx
import pytest
from support.training_runs import MLP, mlp_data, write_npz

GRAPHOPT = [sys.executable, "-P", "-m", "graphopt.cli"]


def graphopt(*args, cwd=None):
    return subprocess.run([*GRAPHOPT, "run", *args], capture_output=True, text=True, cwd=cwd,
                          timeout=120)


@pytest.fixture
def data(tmp_path):
    return write_npz(tmp_path / "d.npz", mlp_data())


def bad_input_cases(tmp_path, data):
    wrong = write_npz(tmp_path / "wrong.npz", {"inputs": mlp_data()["x"]})
    ragged = write_npz(tmp_path / "ragged.npz", {"x": mlp_data()["x"],
                                                  "labels": np.zeros(3, np.int64)})
    not_npz = tmp_path / "junk.npz"
    not_npz.write_text("not a zip")
    base = [MLP, "--data", data, "--loss", "cross_entropy", "--batch-size", "4", "--steps", "1"]
    return {
        "unknown example": (["--example", "nope"], "unknown example"),
        "no model": ([], "MODEL or --example"),
        "missing model file": (["nope.onnx", "--data", data], "no such file"),
        "missing data file": ([MLP, "--data", "nope.npz", "--loss", "cross_entropy"],
                              "no such file"),
        "no data": ([MLP, "--loss", "cross_entropy"], "--data"),
        "unreadable data": ([MLP, "--data", str(not_npz), "--loss", "cross_entropy"], "npz"),
        "wrong array names": ([MLP, "--data", wrong, "--loss", "cross_entropy",
                               "--batch-size", "4"], "no array for graph input"),
        "ragged arrays": ([MLP, "--data", ragged, "--loss", "cross_entropy", "--batch-size", "4"],
                          "length along axis 0"),
        "fixed batch": ([*base[:-4], "--batch-size", "8"], "--batch-size 4"),
        "bad loss": ([*base[:3], "--loss", "hinge", "--batch-size", "4"], "neither"),
        "bad loss scale": ([*base, "--loss-scale", "huge"], "--loss-scale"),
        "bad lr": ([*base, "--lr", "-1"], "--lr"),
        "bad steps": ([*base[:-2], "--steps", "0"], "--steps"),
        "steps and epochs": ([*base, "--epochs", "2"], "not both"),
        "resume without checkpoint": ([*base, "--resume"], "--checkpoint"),
        "freeze typo": ([*base, "--freeze", "fc9.*"], "match"),
        "bad log name": ([*base, "--log", str(tmp_path / "log.txt")], ".csv or .jsonl"),
        "output over input": ([*base, "-o", MLP], "overwrite the input"),
        "output folder missing": ([*base, "-o", str(tmp_path / "no" / "m.onnx")], "does not exist"),
        "bad precision": ([*base, "--precision", "fp8"], "fp8"),
        "bad optimizer": ([*base, "--optimizer", "lion"], "lion"),
        "malformed number": ([*base, "--lr", "fast"], "fast"),
        "unknown option": ([*base, "--learning-rate", "1"], "--learning-rate"),
        "bad level": ([*base, "--level", "3"], "--level"),
    }


def test_bad_input_is_one_line_exit_1(tmp_path, data):
    failures = []
    for label, (args, needle) in bad_input_cases(tmp_path, data).items():
        result = graphopt(*args)
        lines = result.stderr.strip().splitlines()
        ok = (result.returncode == 1 and len(lines) == 1 and "Traceback" not in result.stderr
              and lines[0].startswith("graphopt: error: ") and needle in lines[0])
        if not ok:
            failures.append(f"{label}: rc={result.returncode} stderr={result.stderr!r}")
    assert not failures, "\n".join(failures)


def test_graphopt_errors_exit_1_with_exactly_one_line(tmp_path, data):
    result = graphopt("--example", "nope")
    assert result.returncode == 1
    assert result.stderr == ("graphopt: error: unknown example 'nope'; "
                             "choose one of mqa, mlp-digits\n")


def test_good_run_reports_rules_policy_progress_and_files(tmp_path, data):
    log, graph = tmp_path / "log.jsonl", tmp_path / "train.onnx"
    report = tmp_path / "denormals.json"
    result = graphopt("--example", "mqa", "--steps", "4", "--log", str(log), "--save-graph",
                      str(graph), "--precision", "mixed", "--numerics", "mi200",
                      "--denormal-report", str(report), "-o", str(tmp_path / "m.onnx"))
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "fired: constant_to_initializer, gather_slice_to_split" in out
    assert "mark_backward_pass" in out.split("== training graph")[1]
    assert "numerics mode: mi200" in out and "ROCBLAS_INTERNAL_FP16_ALT_IMPL" in out
    assert "step 4/4" in out and "\r" not in out  # not a terminal: plain lines
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert records[0]["loss_scale"] == 65536.0
    assert json.loads(report.read_text())["mode"] == "mi200"
    # whole files after the process exits (it skips the collections at exit: console.py)
    onnx.checker.check_model(onnx.load(str(graph)))
    onnx.checker.check_model(onnx.load(str(tmp_path / "m.onnx")))


def test_plot_and_csv_log(tmp_path, data):
    pytest.importorskip("matplotlib")
    plot, log = tmp_path / "loss.png", tmp_path / "log.csv"
    result = graphopt(MLP, "--data", data, "--loss", "cross_entropy", "--batch-size", "4",
                      "--epochs", "2", "--plot", str(plot), "--log", str(log), "--optimizer",
                      "sgd", "--lr", "0.1")
    assert result.returncode == 0, result.stderr
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    rows = log.read_text().splitlines()
    assert rows[0].startswith("step,epoch,loss") and len(rows) == 1 + 20  # 40 samples / 4 x 2

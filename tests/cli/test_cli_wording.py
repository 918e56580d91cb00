"""Errors from the library reach a command-line user in command-line words: options, not the
Python parameters (`--device cpu`, not `device='cpu'`)."""
from __future__ import annotations

import importlib.util
import re

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from onnx import TensorProto, helper

from graphopt.cli import PYTHON_TO_CLI, cli_words, main

MLP = "tests/fixtures/mlp.onnx"
PYTHON_WORDS = re.compile(r"\b(device|loss|outputs|labels_name|numerics|precision)=")


def error_line(*args) -> str:
    result = CliRunner().invoke(main, [str(a) for a in args])
    assert result.exit_code == 1, result.output
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("graphopt: error: "), result.stderr
    assert not PYTHON_WORDS.search(lines[0]), lines[0]
    return lines[0]


def data(tmp_path) -> str:
    path = tmp_path / "d.npz"
    np.savez(path, x=np.zeros((8, 64), np.float32), labels=np.zeros(8, np.int64))
    return str(path)


def test_a_non_scalar_output_as_loss_suggests_the_option(tmp_path):
    line = error_line("run", MLP, "--data", data(tmp_path), "--batch-size", "4", "--steps", "1")
    assert "use --loss output" in line


def test_several_outputs_say_what_the_command_line_can_do(tmp_path):
    model = onnx.load(MLP)
    model.graph.output.append(helper.make_tensor_value_info("hidden", TensorProto.FLOAT, [4, 32]))
    model.graph.node[0].output[0] = "hidden"
    model.graph.node[1].input[0] = "hidden"
    path = tmp_path / "two.onnx"
    onnx.save(model, path)
    line = error_line("run", path, "--data", data(tmp_path), "--batch-size", "4", "--steps",
                      "1")
    assert "--loss OUTPUT names a scalar loss output" in line and "cross_entropy:OUTPUT" in line


@pytest.mark.skipif(importlib.util.find_spec("cupy") is not None, reason="CuPy is installed")
def test_gpu_without_cupy_suggests_the_cpu_option():
    line = error_line("run", "--example", "mlp-digits", "--device", "cuda", "--steps", "1")
    assert "use --device cpu" in line


def test_every_translation_applies():
    for python, cli in PYTHON_TO_CLI:
        assert cli_words(f"a {python} b") == f"a {cli} b"

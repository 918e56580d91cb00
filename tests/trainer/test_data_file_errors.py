"""A data file that is not one says what it is, under the option that named it: a folder or
a FIFO is no missing file, and a broken --eval-data is --eval-data's."""
from __future__ import annotations

import os

import numpy as np
import pytest
from support.cli_runs import assert_one_error_line, cli
from support.training_runs import MLP, write_npz


@pytest.fixture
def data(tmp_path) -> str:
    return write_npz(tmp_path / "d.npz", {"x": np.zeros((8, 64), np.float32),
                                          "labels": np.zeros(8, np.int64)})


@pytest.mark.parametrize("option", ["--data", "--eval-data"])
@pytest.mark.parametrize("kind,words", [("folder", "a folder, not a regular .npz file"),
                                        ("fifo", "a FIFO, not a regular .npz file"),
                                        ("garbage", "not a readable .npz file"),
                                        ("missing", "no such file")])
def test_a_bad_data_file_is_named_under_its_option(tmp_path, data, option, kind, words):
    path = tmp_path / kind
    if kind == "folder":
        path.mkdir()
    elif kind == "fifo":
        os.mkfifo(path)
    elif kind == "garbage":
        path.write_bytes(b"not a zip")
    args = ["--data", str(path)] if option == "--data" else \
        ["--data", data, "--eval-data", str(path)]
    code, _, err = cli("run", MLP, "--loss", "cross_entropy", "--batch-size", "4",
                       "--steps", "1", *args)
    assert_one_error_line(code, err, f"{option} {path}: {words}")

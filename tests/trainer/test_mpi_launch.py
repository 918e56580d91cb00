"""`mpiexec -n 4 graphopt run` without --distributed is refused with one line (rank 0 says
it, the other ranks exit 1 quietly) instead of training four unrelated copies."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from support.training_runs import MLP, mlp_data, write_npz

from graphopt.trainer.runner import launched_ranks

RUN = [sys.executable, "-P", "-m", "graphopt.cli", "run"]


@pytest.mark.parametrize("environ, expected", [
    ({"PMI_SIZE": "4", "PMI_RANK": "2"}, (4, 2, "PMI_SIZE=4")),
    ({"OMPI_COMM_WORLD_SIZE": "2", "OMPI_COMM_WORLD_RANK": "0"},
     (2, 0, "OMPI_COMM_WORLD_SIZE=2")),
    ({"SLURM_STEP_NUM_TASKS": "8", "SLURM_PROCID": "7"}, (8, 7, "SLURM_STEP_NUM_TASKS=8")),
    ({"PMI_SIZE": "1", "PMI_RANK": "0"}, None),       # a singleton: one process, fine
    ({"SLURM_NTASKS": "4"}, None),                    # inside an allocation, not launched
    ({}, None),
])
def test_launcher_environments(environ, expected):
    assert launched_ranks(environ) == expected


def _run(tmp_path, env):
    data = write_npz(tmp_path / "d.npz", mlp_data())
    return subprocess.run([*RUN, MLP, "--data", data, "--loss", "cross_entropy",
                           "--batch-size", "4", "--steps", "1"], capture_output=True,
                          text=True, timeout=120, env={**os.environ, **env})


def test_rank_0_refuses_in_one_line_and_the_others_quietly(tmp_path):
    zero = _run(tmp_path, {"PMI_SIZE": "4", "PMI_RANK": "0"})
    assert zero.returncode == 1 and zero.stdout == ""
    assert zero.stderr.splitlines() == [
        "graphopt: error: started as 4 processes by an MPI launcher (PMI_SIZE=4) without "
        "--distributed: each would train its own copy; add --distributed to train "
        "data-parallel, or run one process"]
    other = _run(tmp_path, {"PMI_SIZE": "4", "PMI_RANK": "3"})
    assert other.returncode == 1 and other.stdout == "" and other.stderr == ""


MPIEXEC = shutil.which("mpiexec", path=os.path.dirname(sys.executable) + os.pathsep
                       + os.environ.get("PATH", ""))


@pytest.mark.skipif(MPIEXEC is None, reason="needs mpiexec: pip install 'graphopt[distributed]'")
def test_real_mpiexec_without_distributed_is_refused(tmp_path):
    data = write_npz(tmp_path / "d.npz", mlp_data())
    done = subprocess.run([MPIEXEC, "-n", "2", *RUN, MLP, "--data", data, "--loss",
                           "cross_entropy", "--batch-size", "4", "--steps", "1"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0
    errors = [line for line in done.stderr.splitlines() if line.startswith("graphopt: error")]
    assert len(errors) == 1 and "add --distributed" in errors[0]
    assert "step 1/" not in done.stdout

"""Where the data-parallel tests find mpiexec, and their skip when it or mpi4py is missing."""
from __future__ import annotations

import importlib.util
import os
import shutil
import sys

import pytest


def _mpiexec() -> str | None:
    here = os.path.dirname(sys.executable)   # the mpich wheel installs next to python
    return shutil.which("mpiexec", path=here + os.pathsep + os.environ.get("PATH", ""))


MPIEXEC = _mpiexec()
needs_mpi = pytest.mark.skipif(
    importlib.util.find_spec("mpi4py") is None or MPIEXEC is None,
    reason="needs mpi4py and mpiexec: pip install 'graphopt[distributed]' "
           "(mpi4py + the mpich wheel)")

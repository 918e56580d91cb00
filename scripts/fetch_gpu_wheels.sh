#!/usr/bin/env bash
# The GPU machine has no network: fetch, on a machine with one, the wheels gpu_checks.sh
# installs there (the test runner and the project's pure-Python/small dependencies; CuPy
# itself, ~100+ MB, is expected in the GPU image). Total well under the 64 MiB the device
# tool carries. Carry .wheels with the run:  run(carry=[".wheels"], command="scripts/gpu_checks.sh")
set -euo pipefail
cd "$(dirname "$0")/.."
python_tag="${PYTHON_TAG:-$(python -c 'import sys; print(f"{sys.version_info[0]}{sys.version_info[1]}")')}"
rm -rf .wheels && mkdir -p .wheels
pip download -q --only-binary=:all: --python-version "$python_tag" -d .wheels \
    pytest click onnx-graphsurgeon onnx ml_dtypes
du -sh .wheels

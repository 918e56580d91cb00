#!/usr/bin/env bash
# The GPU machine has no network: fetch the pure-Python dependencies its image lacks.
set -euo pipefail
cd "$(dirname "$0")/.."
pip download -q --no-deps --only-binary=:all: -d .wheels click onnx-graphsurgeon

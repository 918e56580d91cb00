#!/usr/bin/env bash
# Every GPU test and GPU benchmark in one go (target: under five minutes on one GPU).
# Results go to $OUT (the device tool's output folder) or ./gpu-results.
#   scripts/fetch_gpu_wheels.sh   # once, on a machine with network: pure-Python deps in .wheels/
#   scripts/gpu_checks.sh         # on the GPU machine
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-$PWD/gpu-results}"
mkdir -p "$out"
if [ -d .wheels ]; then
  pip install -q --no-index --find-links .wheels --no-deps .wheels/*.whl 2>&1 | tail -1
fi
pip install -q --no-deps --no-build-isolation -e . 2>&1 | tail -1
if ! python -c "import cupy; cupy.cuda.runtime.getDeviceCount()" 2>"$out/no_gpu.txt"; then
  echo "no usable CuPy/GPU here; see $out/no_gpu.txt"
  exit 0
fi
status=0
timeout 150 pytest -q -m gpu tests 2>&1 | tee "$out/pytest_gpu.txt" || status=1
timeout 60 python bench/bench_fp16_gemm.py 2>&1 | tee "$out/bench_fp16_gemm.txt" || status=1
timeout 120 python bench/bench_executor_gpu.py 2>&1 | tee "$out/bench_executor_gpu.txt" || status=1
cp bench/RESULTS.md "$out/RESULTS.md"
exit $status

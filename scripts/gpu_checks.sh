#!/usr/bin/env bash
# Every GPU test and GPU benchmark in one go, self-contained, under 8 minutes on one GPU.
#   scripts/fetch_gpu_wheels.sh    # once, where there is network: .wheels/ (carry it along)
#   scripts/gpu_checks.sh          # on the GPU machine
# Installs the carried wheels into a throw-away venv that sees the image's CuPy/torch
# (--system-site-packages), runs the GPU test files by name (so no test module that needs
# hypothesis or onnxruntime is ever imported), then both GPU benchmarks. Writes, to $OUT (the
# device tool's output folder) or ./gpu-results: summary.json (one object: every step's exit
# code and seconds, pytest counts and failures, the device, the device->host copies per
# training step, the GEMM ratios), pytest_gpu.txt/.xml, the two benchmark logs and RESULTS.md
# with their sections.
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-$PWD/gpu-results}"
mkdir -p "$out"
start_all=$(date +%s)
venv="${TMPDIR:-/tmp}/graphopt-gpu-venv"
python -m venv --system-site-packages "$venv" >/dev/null 2>&1 || true
if [ -x "$venv/bin/python" ]; then py="$venv/bin/python"; else py=python; fi
if [ -d .wheels ]; then
  "$py" -m pip install -q --no-index --find-links .wheels pytest click onnx-graphsurgeon \
      onnx ml_dtypes >"$out/install.txt" 2>&1 || echo "wheel install failed: see install.txt"
fi
# a real build (the source folders run only as an installed package; a plain editable
# install has no graphopt.cli), reinstalled even where this venv has an older one
"$py" -m pip install -q --no-deps --no-build-isolation --force-reinstall . \
    >>"$out/install.txt" 2>&1

declare -A rc seconds
step() {  # step NAME TIMEOUT COMMAND...
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  timeout "$limit" "$@" >"$out/$name.txt" 2>&1
  rc[$name]=$?
  seconds[$name]=$(( $(date +%s) - t0 ))
  tail -5 "$out/$name.txt"
}

step device 60 "$py" -c "
import cupy
n = cupy.cuda.runtime.getDeviceCount()
p = cupy.cuda.runtime.getDeviceProperties(0)
name = p['name'].decode() if isinstance(p['name'], bytes) else p['name']
print(f'{name}; {n} device(s); CuPy {cupy.__version__}; hip={cupy.cuda.runtime.is_hip}')"
if [ "${rc[device]}" = 0 ]; then
  # -P: the repository root must not be on sys.path (its graphopt/ is only part of the package)
  step pytest_gpu 240 "$py" -P -m pytest -q -p no:cacheprovider --junitxml="$out/pytest_gpu.xml" \
      tests/executor/numerics/test_gpu.py tests/executor/test_gpu.py \
      tests/executor/test_cupy_api.py tests/executor/numerics/test_gemm_plan.py \
      tests/trainer/test_fused_adamw.py tests/trainer/test_device_resident.py \
      tests/executor/test_device_transfers.py \
      tests/executor/numerics/test_weight_conversion_cache.py \
      "tests/trainer/distributed/test_distributed.py::test_nccl_transport_single_rank_allreduce"
  # device->host copies per data-parallel step on the device (CUPTI via torch.profiler)
  step gpu_transfers 120 "$py" scripts/gpu_transfers.py
  step bench_fp16_gemm 60 "$py" bench/bench_fp16_gemm.py
  step bench_executor_gpu 150 "$py" bench/bench_executor_gpu.py
  cp bench/RESULTS.md "$out/RESULTS.md"
fi

summary="{"
for name in "${!rc[@]}"; do summary+="\"$name\": {\"rc\": ${rc[$name]}, \"seconds\": ${seconds[$name]}}, "; done
summary+="\"total_seconds\": $(( $(date +%s) - start_all ))}"
"$py" - "$out" "$summary" <<'PY'
import json, os, sys
import xml.etree.ElementTree as ET
out, steps = sys.argv[1], json.loads(sys.argv[2])
summary = {"steps": steps}
with open(os.path.join(out, "device.txt")) as handle:
    summary["device"] = handle.read().strip().splitlines()[-1:]
xml = os.path.join(out, "pytest_gpu.xml")
if os.path.exists(xml):
    root = ET.parse(xml).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    counts = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    failed = [f"{case.get('classname')}::{case.get('name')}: "
              f"{(case.find('failure') if case.find('failure') is not None else case.find('error')).get('message', '')[:300]}"
              for case in suite.iter("testcase")
              if case.find("failure") is not None or case.find("error") is not None]
    summary["pytest"] = {**counts, "failed": failed}
transfers = os.path.join(out, "gpu_transfers.txt")
if os.path.exists(transfers):   # its last line is one JSON object
    lines = [line for line in open(transfers).read().splitlines() if line.startswith("{")]
    summary["transfers"] = json.loads(lines[-1]) if lines else None
bench = os.path.join(out, "bench_executor_gpu.txt")
if os.path.exists(bench):   # the GEMM rows' ratios against cupy.matmul 2-D (targets in the bench)
    summary["gemm_ratios"] = {
        cells[1]: cells[4] for line in open(bench).read().splitlines()
        if line.startswith("| ") and len(cells := [c.strip() for c in line.split("|")]) >= 6
        and cells[4].endswith("%")}
ok = all(step["rc"] == 0 for name, step in steps.items() if isinstance(step, dict))
summary["ok"] = ok
with open(os.path.join(out, "summary.json"), "w") as handle:
    json.dump(summary, handle, indent=1)
print(json.dumps(summary, indent=1))
sys.exit(0 if ok else 1)
PY

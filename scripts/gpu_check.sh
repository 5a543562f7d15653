#!/usr/bin/env bash
# GPU check (README, "GPU check"): on a CUDA machine with torch, transformers and triton
# preinstalled and no network. Installs specfx without dependencies, then runs
# `python -m specfx.gpu_bench`: the CUDA tests first, then the benchmarks, most important first,
# each written to OUT/gpu_bench.json as soon as it ends. Sized for 7 minutes on a cold GPU: the
# benchmark has an internal deadline and a hard timeout behind it.
#   bash scripts/gpu_check.sh [--out DIR] [--dry-run]        (or: make gpu-check)
# OUT: --out DIR, else $OUT, else benchmarks/gpu/DATE-GPU. --dry-run: the same code on the CPU,
# tiny shapes, no install, CUDA parts recorded as skipped (tests/test_gpu_check.py runs it).
# PYTHON: the interpreter (default python3). Exit status: non-zero when a CUDA test fails,
# pytest is missing, or a section raises.
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
out=${OUT:-}
dry=""
while [ $# -gt 0 ]; do
  case "$1" in
    --out) out=${2:?--out needs a folder}; shift 2 ;;
    --dry-run) dry=--dry-run; shift ;;
    *) echo "unknown argument: $1 (expected --out DIR, --dry-run)" >&2; exit 2 ;;
  esac
done
if [ -z "$dry" ]; then
  gpu=$($PY -c "import torch; print(torch.cuda.get_device_name().replace(' ', '-'))") \
    || { echo "no CUDA device (or no torch) for $PY; for a CPU dry run: $0 --dry-run" >&2; exit 1; }
else
  gpu=cpu-dry-run
fi
out=${out:-benchmarks/gpu/$(date +%Y-%m-%d)-$gpu}      # as specfx.gpu_bench.default_out_dir names it
mkdir -p "$out" || exit 1

run_check() {
  echo "# specfx GPU check, $(date -u), $gpu, output in $out"
  if ! $PY -c "import pytest" 2>/dev/null; then
    echo "!! pytest is missing for $PY: the CUDA tests cannot run, so this check will FAIL."
    echo "!! Install it (pip install pytest) or set PYTHON to an interpreter that has it."
  fi
  if [ -z "$dry" ]; then
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
    $PY -m pip install --no-deps --no-index --no-build-isolation -q -e . \
      || { echo "installing specfx failed"; return 1; }
  fi
  # The benchmark stops itself at its --deadline-s; the timeout only catches a hang.
  timeout --kill-after=10 "${GPU_CHECK_TIMEOUT_S:-370}" $PY -m specfx.gpu_bench --out "$out" $dry
  local status=$?
  [ $status -eq 124 ] && echo "gpu_bench hit the hard timeout; $out/gpu_bench.json holds the sections it finished"
  echo "gpu_bench exit status $status; results in $out"
  return $status
}

run_check 2>&1 | tee "$out/gpu_check.log"
exit "${PIPESTATUS[0]}"

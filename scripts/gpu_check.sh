#!/usr/bin/env bash
# GPU check: on a machine with CUDA and torch/transformers/triton preinstalled, and no network.
# Installs specfx without dependencies, runs the CUDA tests, then benchmarks the CUDA-graph step
# (random-init ~1B Llama in bf16 for costs, pycoder for acceptance). Output: benchmarks/gpu/DATE-GPU/
#   bash scripts/gpu_check.sh          (or: make gpu-check)
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
gpu=$($PY -c "import torch; print(torch.cuda.get_device_name().replace(' ', '-'))") || { echo "no CUDA device"; exit 1; }
out="benchmarks/gpu/$(date +%Y-%m-%d)-${gpu}"
mkdir -p "$out"
log="$out/gpu_check.log"
{
  echo "# specfx GPU check, $(date -u), $gpu"
  $PY -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__)"
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv || true
  $PY -m pip install --no-deps --no-build-isolation -q -e . || exit 1
  timeout 240 $PY -m pytest -q -m cuda tests/test_cudagraph.py
  echo "cuda tests exit: $?"
  timeout 300 $PY -m specfx.gpu_bench --out "$out"
  echo "gpu_bench exit: $?"
} 2>&1 | tee "$log"
echo "wrote $out"

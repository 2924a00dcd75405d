#!/usr/bin/env bash
# One short check for a lent GPU machine: GPU tests, one GSPO step, one OPD step and one merge-candidate
# scoring on cuda in bf16, Triton kernel bench, SGLang smoke test.
# Usage: scripts/gpu_check.sh [BASE_DIR]   (BASE_DIR: an HF model dir with tokenizer, e.g. the lab base)
# Each step prints SKIP with a reason when it cannot run; the exit code is 1 if any step failed.
set -u
cd "$(dirname "$0")/.."
[ -f .venv/bin/activate ] && . .venv/bin/activate
BASE_DIR="${1:-}"
status=0

echo "== device"
if command -v nvidia-smi >/dev/null; then
  nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
else
  echo "no nvidia-smi"
fi
python - <<'PY'
import torch
print(f"torch {torch.__version__}, cuda available: {torch.cuda.is_available()}")
try:
    import triton
    print(f"triton {triton.__version__}")
except ImportError:
    print("triton not installed")
PY

echo "== pytest -m gpu"
python -m pytest -m gpu -q -rs tests/ || status=1

echo "== device steps (cuda, bf16)"
timeout 300 python scripts/gpu_check.py --steps || status=1

echo "== kernel bench (CUDA)"
if python -c "import sys, opd_kernels; sys.exit(0 if opd_kernels.triton_available() else 1)"; then
  timeout 300 python bench/bench_kernels.py --device cuda || status=1
else
  echo "SKIP kernel bench: needs CUDA and triton"
fi

echo "== sglang smoke"
timeout 420 python scripts/gpu_check.py ${BASE_DIR:+"$BASE_DIR"} || status=1

echo "== gpu_check exit $status"
exit $status

#!/usr/bin/env bash
# GPU benchmark (needs an NVIDIA GPU; about 3-5 minutes on one modern GPU, stopped at 8):
# Faster R-CNN and Mask R-CNN R50-FPN, batch 8 of 800x1333 synthetic images, random init,
# fp32 and AMP, the trainer's path vs a bare loop: images/s and peak memory, as a markdown
# table in bench/GPU_RESULTS.md (and on stdout).
#
#   bench/gpu.sh [options of python -m bench.gpu_bench, e.g. --tracking none --iters 20]
#
# The whole-job checks on the GPU (CLI jobs: AMP, preemption, deterministic resume, CPU serving) are
# `python -m bench.gpu_checks` (bench/GPU_CHECKS.md; about 8 minutes).
#
# PYTHON picks the interpreter (default: .venv/bin/python if present, else python3).
set -euo pipefail
cd "$(dirname "$0")/.."

if [[ -n "${PYTHON:-}" ]]; then py="$PYTHON"
elif [[ -x .venv/bin/python ]]; then py=.venv/bin/python
else py=python3
fi

die() { echo "bench/gpu.sh: $*" >&2; exit 2; }

command -v nvidia-smi >/dev/null 2>&1 || die "no NVIDIA GPU here (nvidia-smi not found); run this on a GPU machine"
nvidia-smi -L >/dev/null 2>&1 || die "nvidia-smi finds no usable GPU: $(nvidia-smi -L 2>&1 | head -1)"
"$py" - <<'EOF' || die "$("$py" -c 'import torch; print(f"torch {torch.__version__} (cuda {torch.version.cuda}) sees no CUDA device")' 2>&1 | tail -1)"
import sys
import torch
sys.exit(0 if torch.cuda.is_available() else 1)
EOF

exec timeout --signal=INT --kill-after=20 470 "$py" -m bench.gpu_bench "$@"

#!/usr/bin/env bash
# Creates ./.venv (Python 3.12 when available, as on the GPU machine) and
# installs maxattn into it with the given extras (default: test).
# Usage: tools/setup_env.sh [extras]     e.g. tools/setup_env.sh demo
set -euo pipefail
cd "$(dirname "$0")/.."
extras="${1:-test}"

pick_python() {
  for cand in python3.12 /root/.pyenv/versions/3.12.*/bin/python3.12 "$HOME"/.pyenv/versions/3.12.*/bin/python3.12 python3; do
    if command -v "$cand" >/dev/null 2>&1 && "$cand" -c 'import sys; sys.exit(sys.version_info < (3, 10))' 2>/dev/null; then
      echo "$cand"; return
    fi
  done
  echo "no Python >= 3.10 found" >&2; exit 1
}

if [ ! -x .venv/bin/python ]; then
  py="$(pick_python)"
  echo "[setup] creating .venv with $("$py" --version)"
  "$py" -m venv .venv
fi
pip=".venv/bin/python -m pip"
$pip install -q --upgrade pip
# The cuDNN module is built where this machine has an NVIDIA GPU (MAXATTN_CUDA=AUTO); elsewhere
# (CI, laptops) only the CPU module, since tools/cuda_build_check.sh compile-checks the cuDNN one.
# Set MAXATTN_CUDA=ON / AUTO / OFF to choose.
if [ -z "${MAXATTN_CUDA:-}" ]; then
  if [ -e /proc/driver/nvidia/version ] || command -v nvidia-smi >/dev/null 2>&1; then
    MAXATTN_CUDA=AUTO
  else
    MAXATTN_CUDA=OFF
  fi
fi
export MAXATTN_CUDA
# Build requirements first, so the package builds without isolation (one jax download, not two).
reqs=("scikit-build-core>=0.11" "nanobind>=2.4" "jax>=0.10" "jaxlib>=0.10" cmake ninja)
[ "$MAXATTN_CUDA" != OFF ] && reqs+=("nvidia-cudnn-frontend>=1.32")
$pip install -q "${reqs[@]}"
$pip install -q --no-build-isolation ".[${extras}]"
echo "[setup] installed maxattn[${extras}] into .venv (MAXATTN_CUDA=$MAXATTN_CUDA)"

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
# Build requirements first, so the package builds without isolation (one jax download, not two).
$pip install -q "scikit-build-core>=0.10" "nanobind>=2.4" "jax>=0.10" "jaxlib>=0.10" cmake ninja
$pip install -q --no-build-isolation ".[${extras}]"
echo "[setup] installed maxattn[${extras}] into .venv"

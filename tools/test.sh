#!/usr/bin/env bash
# The README's test command: installs maxattn into ./.venv, then runs the C++
# (GoogleTest) and Python (pytest) suites on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup_env.sh test

echo "[test] C++ core: GoogleTest"
cmake -S . -B build/cpp-tests -DMAXATTN_BUILD_PYTHON=OFF -DMAXATTN_BUILD_TESTS=ON -DMAXATTN_CUDA=OFF \
  -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build/cpp-tests -j "$(nproc)"
ctest --test-dir build/cpp-tests --output-on-failure -j "$(nproc)"

echo "[test] Python: pytest"
.venv/bin/python -m pytest tests/python -n "$(nproc)" -q "$@"

#!/usr/bin/env bash
# The README's test command: installs maxattn into ./.venv, then runs the C++
# (GoogleTest) and Python (pytest) suites on the CPU, builds the docs, and smoke-tests
# the CPU wheel in a fresh venv.
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup_env.sh test
export PATH="$PWD/.venv/bin:$PATH"  # the venv's cmake and ninja

echo "[test] C++ core: GoogleTest"
cmake -S . -B build/cpp-tests -DMAXATTN_BUILD_PYTHON=OFF -DMAXATTN_BUILD_TESTS=ON -DMAXATTN_CUDA=OFF \
  -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build/cpp-tests -j "$(nproc)"
ctest --test-dir build/cpp-tests --output-on-failure -j "$(nproc)"

echo "[test] docs: mkdocs build --strict (API reference from the docstrings; warnings are errors)"
.venv/bin/mkdocs build --strict --quiet

echo "[test] wheel: CPU wheel (auditwheel), installed in a fresh venv without a compiler, smoke test"
tools/wheel_smoke.sh

echo "[test] cuDNN module: compile and link check (runs on the GPU machine only)"
tools/cuda_build_check.sh

echo "[test] sanitizers: ASan+UBSan (C++ tests + a Python slice) and valgrind; see TESTING.md"
tools/sanitize.sh

echo "[test] Python: pytest, sharding and context parallelism on 8 simulated devices"
XLA_FLAGS=--xla_force_host_platform_device_count=8 .venv/bin/python -m pytest tests/python/test_sharding.py -q

echo "[test] Python: pytest, everything else"
.venv/bin/python -m pytest tests/python -n "$(nproc)" -q --ignore=tests/python/test_sharding.py "$@"

#!/usr/bin/env bash
# Compile-and-link check of the cuDNN extension module on a machine without a
# GPU (CI): builds _maxattn_cuda with MAXATTN_CUDA=ON and fails if the module
# has undefined symbols other than Python's (which the interpreter provides);
# then builds and runs the sm90 kernels' host-only layout checks.
# Skips (exit 0, saying so) only when nvcc is absent.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-$PWD/.venv/bin/python}  # absolute: CMake runs it from the build folder
if ! command -v nvcc >/dev/null 2>&1 && [ ! -x /usr/local/cuda/bin/nvcc ]; then
  echo "[cuda-check] no nvcc on this machine: cuDNN module not built"; exit 0
fi
export PATH="$PATH:/usr/local/cuda/bin"
$py -m pip install -q "nvidia-cudnn-frontend>=1.10" "nvidia-cutlass==4.2.0.0"  # CUTLASS: the sm90 kernels
cmake -S . -B build/cuda-check -DMAXATTN_CUDA=ON -DMAXATTN_BUILD_TESTS=OFF \
  -DPython_EXECUTABLE="$py" -DCMAKE_BUILD_TYPE=Release >/dev/null
cmake --build build/cuda-check -j "$(nproc)" --target _maxattn_cuda
module=$(ls build/cuda-check/csrc/ffi/_maxattn_cuda*.so)
missing=$(LD_LIBRARY_PATH="/usr/local/cuda/lib64:${LD_LIBRARY_PATH:-}" ldd -r "$module" 2>&1 \
  | grep "undefined symbol" | grep -v -E "symbol: _?Py" || true)
if [ -n "$missing" ]; then
  echo "[cuda-check] $module has unresolved symbols:"; echo "$missing"; exit 1
fi
echo "[cuda-check] built and linked $module; no unresolved non-Python symbols"
# Host-only layout checks of the sm90 kernels (tests/cuda/sm90_layout_check.cu), when they were built in.
if [ -d build/cuda-check/csrc/maxattn/sm90 ]; then
  cmake --build build/cuda-check -j "$(nproc)" --target sm90_layout_check
  build/cuda-check/csrc/maxattn/sm90/sm90_layout_check
fi

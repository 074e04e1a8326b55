#!/usr/bin/env bash
# Sanitizer runs of the CPU backend (issue 8). Zero reports or it fails.
#   1. ASan + UBSan build (-DMAXATTN_SANITIZE=ON, gcc's runtime) of the core,
#      its GoogleTest suite and the CPU FFI module `_maxattn_cpu`.
#   2. The C++ tests under ASan+UBSan (leak checking on).
#   3. A representative slice of the Python tests with the sanitized module
#      and libasan preloaded into CPython (leak checking off: CPython and
#      jaxlib keep allocations alive at exit by design).
#   4. valgrind memcheck of a plain (unsanitized) build of a small subset of
#      the C++ tests.
# Usage: tools/sanitize.sh            (uses ./.venv/bin/python, else python3)
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
py="${PYTHON:-$root/.venv/bin/python}"
[ -x "$py" ] || py="$(command -v python3)"
jobs="$(nproc)"
t0=$SECONDS

echo "[sanitize] ASan+UBSan build (core, C++ tests, CPU FFI module)"
cmake -S . -B build/sanitize -DMAXATTN_SANITIZE=ON -DMAXATTN_BUILD_TESTS=ON -DMAXATTN_BUILD_PYTHON=ON \
  -DMAXATTN_CUDA=OFF -DCMAKE_BUILD_TYPE=RelWithDebInfo -DPython_EXECUTABLE="$py" >/dev/null
cmake --build build/sanitize -j "$jobs" --target maxattn_core_test _maxattn_cpu

export UBSAN_OPTIONS="halt_on_error=1:print_stacktrace=1"
echo "[sanitize] C++ tests under ASan+UBSan"
ASAN_OPTIONS="detect_leaks=1:halt_on_error=1:abort_on_error=1" build/sanitize/tests/cpp/maxattn_core_test \
  --gtest_brief=1

echo "[sanitize] Python slice under ASan+UBSan (libasan preloaded)"
pkg="$root/build/sanitize/pypkg"
rm -rf "$pkg" && mkdir -p "$pkg"
cp -r python/maxattn "$pkg/"
rm -f "$pkg"/maxattn/_maxattn_*.so
cp build/sanitize/csrc/ffi/_maxattn_cpu*.so "$pkg/maxattn/"
libasan="$(gcc -print-file-name=libasan.so)"
[ -f "$libasan" ] || { echo "libasan not found ($libasan)"; exit 1; }
# libstdc++ preloaded too: python3 itself does not link it, and ASan's __cxa_throw
# interceptor must find the real one at start-up.
preload="$libasan $(gcc -print-file-name=libstdc++.so)"
log="build/sanitize/python-asan.log"
# The sanitized module must be the one imported; then the slice.
LD_PRELOAD="$preload" ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:abort_on_error=1" \
PYTHONPATH="$pkg" JAX_PLATFORMS=cpu MAXATTN_HYPOTHESIS_EXAMPLES="${MAXATTN_SANITIZE_EXAMPLES:-10}" \
  "$py" -c "import maxattn._maxattn_cpu as m, sys; assert m.__file__.startswith('$pkg'), m.__file__"
LD_PRELOAD="$preload" ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:abort_on_error=1:log_path=$root/$log" \
PYTHONPATH="$pkg" JAX_PLATFORMS=cpu MAXATTN_HYPOTHESIS_EXAMPLES="${MAXATTN_SANITIZE_EXAMPLES:-10}" \
  "$py" -m pytest -q -p no:cacheprovider -n "$jobs" --rootdir="$root" \
    tests/python/test_failures.py tests/python/test_concurrency.py tests/python/test_extreme.py \
    tests/python/test_properties.py -k "not 2_31"
if ls "$root/$log".* >/dev/null 2>&1; then
  echo "[sanitize] sanitizer reports:"; cat "$root/$log".*; exit 1
fi

echo "[sanitize] valgrind memcheck of a small C++ test binary"
# The plain test binary that tools/test.sh builds; built here when run alone.
vg_bin=build/cpp-tests/tests/cpp/maxattn_core_test
if [ ! -x "$vg_bin" ]; then
  cmake -S . -B build/cpp-tests -DMAXATTN_BUILD_PYTHON=OFF -DMAXATTN_BUILD_TESTS=ON -DMAXATTN_CUDA=OFF \
    -DCMAKE_BUILD_TYPE=Release >/dev/null
  cmake --build build/cpp-tests -j "$jobs" --target maxattn_core_test
fi
valgrind --tool=memcheck --error-exitcode=1 --leak-check=full --errors-for-leak-kinds=definite,indirect \
  --show-leak-kinds=definite,indirect -q \
  "$vg_bin" --gtest_brief=1 \
  --gtest_filter="${MAXATTN_VALGRIND_FILTER:-Validate.*:ThreadPool.*:CpuAttention.CausalAlignments:CpuAttention.BiasBroadcastPatterns:CpuAttention.FullyMaskedRows:CpuAttention.ZeroSizes:CpuAttentionBackward.SoftcapSegmentsWindow:CpuDropoutSink.DropoutF*}"
echo "[sanitize] done in $((SECONDS - t0)) s: zero ASan/UBSan/valgrind reports"

#!/usr/bin/env bash
# Builds and runs the standalone sm90 harnesses (forward and backward) on an
# H200 (device machine): configure + build (CMake, MAXATTN_SM90_HARNESS=ON),
# SASS evidence (HGMMA / UTMALDG / STSM / REDG counts, local-memory traffic),
# register report, the numerics matrices, compute-sanitizer memcheck /
# racecheck / synccheck on the small cases, then the timed shapes. Logs go to
# $OUT (or ./sm90_out). HARNESSES="fwd bwd" (default) picks the harnesses.
#
# Needs the CUTLASS headers in .cutlass/include (pip download --no-deps
# nvidia-cutlass==4.2.0.0; unpack cutlass_library/source/include there) or
# MAXATTN_CUTLASS_INCLUDE_DIR. Usage: tools/sm90_harness.sh [all|build|test|sanitize|perf]...
# PERF_ARGS (e.g. "--shape 0") are passed to the timed runs. HARNESS_DIR=build/prebuilt/<name>-<sha>
# runs the harnesses built there (tools/prebuild_harness.sh) instead of building them: no build stage.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
out=${OUT:-$PWD/sm90_out}
mkdir -p "$out"
export PATH="$PATH:/usr/local/cuda/bin"
build=build/sm90
jobs=${JOBS:-$(nproc)}
stages=${*:-all}
harnesses=${HARNESSES:-fwd bwd}
want() { [[ " $stages " == *" all "* || " $stages " == *" $1 "* ]]; }
rc=0

if [ -z "${HARNESS_DIR:-}" ] && { want build || want test || want sanitize || want perf; }; then
  if [ ! -x "$build/tests/cuda/sm90_fwd_harness" ] || [ ! -x "$build/tests/cuda/sm90_bwd_harness" ] || want build; then
    echo "== build ($jobs jobs)"
    cmake -S . -B "$build" -DMAXATTN_BUILD_PYTHON=OFF -DMAXATTN_CUDA=OFF -DMAXATTN_SM90_HARNESS=ON \
      -DCMAKE_BUILD_TYPE=Release ${MAXATTN_CUTLASS_INCLUDE_DIR:+-DMAXATTN_CUTLASS_INCLUDE_DIR=$MAXATTN_CUTLASS_INCLUDE_DIR} \
      >"$out/cmake.log" 2>&1 || { cat "$out/cmake.log"; exit 1; }
    # -Xptxas -v through the per-file flags would rebuild everything; the
    # register report is read from the object files below instead.
    if ! cmake --build "$build" -j "$jobs" >"$out/build.log" 2>&1; then
      grep -E "error|warning" "$out/build.log" | head -40; echo "BUILD FAILED"; exit 1
    fi
    grep -iE "warning" "$out/build.log" | sort -u | head -20 || true
    echo "build ok"
    lib=$(find "$build" -name "libmaxattn_sm90.a" | head -1)
    cuobjdump -sass "$lib" >"$out/sm90.sass" 2>&1 || true
    cuobjdump -res-usage "$lib" 2>&1 | grep -E "Function|REG" | paste - - | sed -E 's/ +/ /g' >"$out/res_usage.txt" || true
    echo "== SASS evidence (every kernel in libmaxattn_sm90.a)"
    for ins in HGMMA UTMALDG STSM REDG SYNCS LDL STL; do
      printf '%-8s %s\n' "$ins" "$(grep -c "$ins" "$out/sm90.sass")"
    done
    grep -oE "HGMMA\.[0-9A-Za-z]+\.[A-Z0-9.]+" "$out/sm90.sass" | sort | uniq -c | head -12
    cat "$out/res_usage.txt" | cut -c1-220
  fi
fi

for h in $harnesses; do
  bin=${HARNESS_DIR:-$build/tests/cuda}/sm90_${h}_harness
  if want test; then
    echo "== numerics ($h)"
    timeout "${RUN_TIMEOUT:-300}" "$bin" --no-perf 2>&1 | tee "$out/test_$h.log" || rc=1
  fi
  if want sanitize; then
    for tool in memcheck racecheck synccheck; do
      echo "== compute-sanitizer --tool $tool (small cases, $h)"
      timeout "${SAN_TIMEOUT:-240}" compute-sanitizer --tool "$tool" --error-exitcode 9 "$bin" --small \
        >"$out/sanitize_${h}_$tool.log" 2>&1
      s=$?
      tail -4 "$out/sanitize_${h}_$tool.log"
      echo "exit $s"; [ $s -eq 0 ] || rc=1
    done
  fi
  if want perf; then
    echo "== timing ($h, bf16, medians of cudaEvents around each call)"
    timeout "${RUN_TIMEOUT:-300}" "$bin" --perf-only ${PERF_ARGS:-} 2>&1 | tee "$out/perf_$h.log" || rc=1
  fi
done
exit $rc

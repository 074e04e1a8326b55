#!/usr/bin/env bash
# On the device machine: runs every harness under build/prebuilt/*/ (made here by
# tools/prebuild_harness.sh or copied from a local build: sm90_bwd_harness and/or
# sm90_fwd_harness per folder) -- numerics once, then the timed shapes REPS times with the
# binaries interleaved (so drift hits all of them alike), then (backward) the deterministic mode
# once -- and prints one table per run. Carry "build/prebuilt".
#
#   tools/compare_prebuilt.sh [PERF_ARGS...]     # e.g. --shape 0; REPS=3 by default
#   HARNESSES="sm90_fwd_harness" tools/compare_prebuilt.sh   # only the forward ones
set -u -o pipefail
cd "$(dirname "$0")/.." || exit 1
out=${OUT:-$PWD/prebuilt_out}
mkdir -p "$out"
dirs=$(find build/prebuilt -mindepth 1 -maxdepth 1 -type d 2>/dev/null | sort)
[ -n "$dirs" ] || { echo "no build/prebuilt/*/ harnesses"; exit 1; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
rc=0
for h in ${HARNESSES:-sm90_bwd_harness sm90_fwd_harness}; do
  bins=$(for d in $dirs; do [ -x "$d/$h" ] && echo "$d"; done)
  [ -n "$bins" ] || continue
  echo "#### $h"
  for b in $bins; do
    name=$(basename "$b")
    echo "== $name: $(cut -c1-100 "$b/REVISION" 2>/dev/null)"
    timeout "${RUN_TIMEOUT:-120}" "$b/$h" --no-perf >"$out/num_${h%_harness}_$name.log" 2>&1 || rc=1
    tail -1 "$out/num_${h%_harness}_$name.log"; grep -iE "fail|mismatch" "$out/num_${h%_harness}_$name.log" | head -5
  done
  for rep in $(seq "${REPS:-3}"); do
    for b in $bins; do
      echo "== $(basename "$b") (timing $rep)"
      timeout "${RUN_TIMEOUT:-120}" "$b/$h" --perf-only "$@" 2>&1 | grep -E "^[0-9]" || rc=1
    done
  done
  [ "$h" = sm90_bwd_harness ] || continue
  for b in $bins; do
    echo "== $(basename "$b") (deterministic)"
    timeout "${RUN_TIMEOUT:-120}" "$b/$h" --perf-only --deterministic "$@" 2>&1 | grep -E "^[0-9]" || rc=1
  done
done
exit $rc

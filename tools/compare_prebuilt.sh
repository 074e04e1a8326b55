#!/usr/bin/env bash
# On the device machine: runs every backward harness under build/prebuilt/*/ (made here by
# tools/prebuild_harness.sh or copied from a local build) -- numerics once, then the timed shapes
# REPS times with the binaries interleaved (so drift hits all of them alike), then the
# deterministic mode once -- and prints one table per run. Carry "build/prebuilt".
#
#   tools/compare_prebuilt.sh [PERF_ARGS...]     # e.g. --shape 0; REPS=3 by default
set -u -o pipefail
cd "$(dirname "$0")/.." || exit 1
out=${OUT:-$PWD/prebuilt_out}
mkdir -p "$out"
bins=$(find build/prebuilt -mindepth 1 -maxdepth 1 -type d 2>/dev/null | sort)
[ -n "$bins" ] || { echo "no build/prebuilt/*/ harnesses"; exit 1; }
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
rc=0
for b in $bins; do
  name=$(basename "$b")
  echo "== $name: $(cut -c1-100 "$b/REVISION" 2>/dev/null)"
  timeout "${RUN_TIMEOUT:-120}" "$b/sm90_bwd_harness" --no-perf >"$out/num_$name.log" 2>&1 || rc=1
  tail -1 "$out/num_$name.log"; grep -iE "fail|mismatch" "$out/num_$name.log" | head -5
done
for rep in $(seq "${REPS:-3}"); do
  for b in $bins; do
    echo "== $(basename "$b") (timing $rep)"
    timeout "${RUN_TIMEOUT:-120}" "$b/sm90_bwd_harness" --perf-only "$@" 2>&1 | grep -E "^[0-9]" || rc=1
  done
done
for b in $bins; do
  echo "== $(basename "$b") (deterministic)"
  timeout "${RUN_TIMEOUT:-120}" "$b/sm90_bwd_harness" --perf-only --deterministic "$@" 2>&1 | grep -E "^[0-9]" || rc=1
done
exit $rc

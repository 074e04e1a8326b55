#!/usr/bin/env bash
# On the device machine: runs every harness under build/prebuilt/*/ (made here by
# tools/prebuild_harness.sh or copied from a local build: sm90_bwd_harness and/or
# sm90_fwd_harness per folder) -- numerics once, then the timed shapes REPS times with the
# binaries interleaved (so drift hits all of them alike), then (backward) the deterministic mode
# once -- and prints one table per run. Carry "build/prebuilt".
#
#   tools/compare_prebuilt.sh [PERF_ARGS...]     # e.g. --shape 0; REPS=3 by default
#   HARNESSES="sm90_fwd_harness" tools/compare_prebuilt.sh   # only the forward ones
#   NUMERICS=0 tools/compare_prebuilt.sh --shape 1           # timings only (numerics ran in an earlier call)
#   SANITIZE="comb writer" tools/compare_prebuilt.sh          # then compute-sanitizer racecheck and
#       synccheck (SAN_TOOLS) on the small cases of each harness (of HARNESSES) in every folder
#       whose name starts with one of these words
# Logs: $OUT/numerics.log (every numerics run, whole) and $OUT/sanitize.log -- two files, since
# the device tool brings back at most eight.
set -u -o pipefail
cd "$(dirname "$0")/.." || exit 1
out=${OUT:-$PWD/prebuilt_out}
mkdir -p "$out"
rm -f "$out/numerics.log" "$out/sanitize.log"
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
    [ "${NUMERICS:-1}" = 1 ] || continue
    log=$(mktemp)
    timeout "${RUN_TIMEOUT:-120}" "$b/$h" --no-perf >"$log" 2>&1 || rc=1
    tail -1 "$log"; grep -iE "fail|mismatch" "$log" | head -5
    { echo "==== $h $name"; cat "$log"; } >>"$out/numerics.log"; rm -f "$log"
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
for word in ${SANITIZE:-}; do
  for d in $dirs; do
    [[ $(basename "$d") == "$word"* ]] || continue
    for h in ${HARNESSES:-sm90_bwd_harness sm90_fwd_harness}; do
      [ -x "$d/$h" ] || continue
      for tool in ${SAN_TOOLS:-racecheck synccheck}; do
        echo "== compute-sanitizer --tool $tool $(basename "$d")/$h --small"
        log=$(mktemp)
        timeout "${SAN_TIMEOUT:-120}" compute-sanitizer --tool "$tool" --error-exitcode 9 "$d/$h" --small \
          >"$log" 2>&1 || rc=1
        tail -2 "$log"
        { echo "==== $tool $(basename "$d")/$h"; cat "$log"; } >>"$out/sanitize.log"; rm -f "$log"
      done
    done
  done
done
exit $rc

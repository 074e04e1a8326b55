#!/usr/bin/env bash
# On the device machine: Nsight Compute device time (and executed warp instructions) of one
# kernel of every prebuilt harness (tools/prebuild_harness.sh; carry "build/prebuilt"), per
# timed shape, so that two builds of a kernel compare within ~0.5% where cudaEvent timings
# spread by several percent. Prints one line per (binary, shape): the median over the profiled
# launches.
#
#   tools/ncu_prebuilt.sh fwd 0 4 6        # FwdKernel of every sm90_fwd_harness, shapes 0, 4, 6
#   tools/ncu_prebuilt.sh bwd 0 1          # the backward's main kernel (BwdKernel)
#   NCU_ARGS="--softcap 50" tools/ncu_prebuilt.sh fwd 0   # harness options for the timed runs
#   ONLY="main earlyq" ...                 # only the folders whose names start with these words
# The forward harness's timed loop alternates launches without and with max_logit (after three
# warm-up pairs): fwd profiles launches 7..22 and reports both medians and max_logit's cost; bwd
# profiles the main kernel's launches 4..11 (SKIP, COUNT).
set -u -o pipefail
cd "$(dirname "$0")/.." || exit 1
which=${1:?usage: tools/ncu_prebuilt.sh fwd|bwd SHAPE...}; shift
case $which in
  fwd) harness=sm90_fwd_harness; kernel=FwdKernel; skip=${SKIP:-6}; count=${COUNT:-16} ;;
  bwd) harness=sm90_bwd_harness; kernel=BwdKernel; skip=${SKIP:-3}; count=${COUNT:-8} ;;
  *) echo "fwd or bwd"; exit 2 ;;
esac
ncu=$(command -v ncu || echo /usr/local/cuda/bin/ncu)
tmp=$(mktemp -d)
if [ "$which" = fwd ]; then
  printf "%-24s %5s %10s %10s %8s %10s %8s\n" binary shape "us" "us(+max)" "max" "inst (M)" launches
else
  printf "%-24s %5s %10s %10s %8s\n" binary shape "us" "inst (M)" launches
fi
for d in $(find build/prebuilt -mindepth 1 -maxdepth 1 -type d | sort); do
  [ -x "$d/$harness" ] || continue
  name=$(basename "$d")
  if [ -n "${ONLY:-}" ]; then
    keep=0; for w in $ONLY; do [[ $name == "$w"* ]] && keep=1; done
    [ $keep = 1 ] || continue
  fi
  for shape in "$@"; do
    csv=$tmp/$name-$shape.csv
    # shellcheck disable=SC2086  # NCU_ARGS is a list of harness options
    timeout "${NCU_TIMEOUT:-120}" "$ncu" --csv --kernel-name-base function -k "regex:^$kernel" \
      --launch-skip "$skip" --launch-count "$count" \
      --metrics gpu__time_duration.sum,smsp__inst_executed.sum \
      "$d/$harness" --perf-only --shape "$shape" ${NCU_ARGS:-} >"$csv" 2>"$tmp/err" \
      || { echo "$name shape $shape: ncu failed"; tail -3 "$tmp/err"; continue; }
    python3 - "$csv" "$name" "$shape" "$which" <<'PY'
import csv, statistics, sys
path, name, shape, which = sys.argv[1:]
rows = [r for r in csv.reader(l for l in open(path) if l.startswith('"'))]
head, body = rows[0], rows[1:]
col = {k: i for i, k in enumerate(head)}
t, inst = {}, {}
scale = {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3, "msecond": 1e3}
for r in body:
    launch = int(r[col["ID"]])
    metric, value = r[col["Metric Name"]], float(r[col["Metric Value"]].replace(",", ""))
    if metric == "gpu__time_duration.sum":
        t[launch] = value * scale[r[col["Metric Unit"]]]
    elif metric == "smsp__inst_executed.sum":
        inst[launch] = value
ids = sorted(t)
med = lambda xs: statistics.median(xs) if xs else float("nan")
if which == "fwd":  # even positions: without max_logit, odd: with it
    a = med([t[i] for i in ids[0::2]]); b = med([t[i] for i in ids[1::2]])
    mi = med([inst[i] for i in ids[0::2] if i in inst]) / 1e6
    print(f"{name:<24} {shape:>5} {a:10.2f} {b:10.2f} {100 * (b / a - 1):7.2f}% {mi:10.2f} {len(ids):8d}")
else:
    mi = med([inst[i] for i in ids if i in inst]) / 1e6
    print(f"{name:<24} {shape:>5} {med([t[i] for i in ids]):10.2f} {mi:10.2f} {len(ids):8d}")
PY
  done
done
rm -rf "$tmp"

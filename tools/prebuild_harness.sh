#!/usr/bin/env bash
# Builds the standalone sm90 harnesses of a git revision HERE (nvcc compiles
# sm_90a without a GPU) into build/prebuilt/<name>-<sha>/, so that a device
# call only runs them: carry "build/prebuilt" and call
#   build/prebuilt/<name>-<sha>/sm90_bwd_harness [--no-perf | --perf-only ...]
# Two revisions built this way compare in one device call without a build
# there (the device machine's build of the harnesses costs ~90 s of device time).
#
#   tools/prebuild_harness.sh REV [NAME]    # e.g. tools/prebuild_harness.sh wip/bwd-dq-bulk-reduce wip
#   CUDA_FLAGS="-DMAXATTN_SM90_H64_SOFTCAP_VARIANT=3" TARGETS=sm90_fwd_harness \
#     tools/prebuild_harness.sh main capv3         # a compile-time variant of a revision, one harness
#
# Needs the CUTLASS headers in .cutlass/include (as tools/sm90_harness.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
rev=${1:?usage: tools/prebuild_harness.sh REV [NAME]}
sha=$(git rev-parse --short "$rev")
name=${2:-$(echo "$rev" | tr '/' '-')}
targets=${TARGETS:-sm90_fwd_harness sm90_bwd_harness}
tree=build/worktrees/$sha
out=build/prebuilt/$name-$sha
[ -d "$tree" ] || git worktree add --detach "$tree" "$sha" >/dev/null
# One build folder per set of flags, so that variants of one revision do not rebuild each other.
bdir=$tree/build${CUDA_FLAGS:+-$(echo "$CUDA_FLAGS" | md5sum | cut -c1-8)}
cmake -S "$tree" -B "$bdir" -DMAXATTN_BUILD_PYTHON=OFF -DMAXATTN_CUDA=OFF -DMAXATTN_SM90_HARNESS=ON \
  -DCMAKE_BUILD_TYPE=Release -DMAXATTN_CUTLASS_INCLUDE_DIR="$PWD/.cutlass/include" \
  -DCMAKE_CUDA_FLAGS="${CUDA_FLAGS:-}" >/dev/null
# shellcheck disable=SC2086  # targets is a list
cmake --build "$bdir" -j "${JOBS:-$(nproc)}" --target $targets
mkdir -p "$out"
for t in $targets; do cp "$bdir/tests/cuda/$t" "$out/"; done
{ git -C "$tree" log -1 --format='%h %s'; [ -z "${CUDA_FLAGS:-}" ] || echo "CUDA_FLAGS: $CUDA_FLAGS"; } > "$out/REVISION"
echo "$out"

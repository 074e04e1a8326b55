#!/usr/bin/env bash
# Builds the standalone sm90 harnesses of a git revision HERE (nvcc compiles
# sm_90a without a GPU) into build/prebuilt/<name>-<sha>/, so that a device
# call only runs them: carry "build/prebuilt" and call
#   build/prebuilt/<name>-<sha>/sm90_bwd_harness [--no-perf | --perf-only ...]
# Two revisions built this way compare in one device call without a build
# there (the device machine's build of the harnesses costs ~90 s of device time).
#
#   tools/prebuild_harness.sh REV [NAME]    # e.g. tools/prebuild_harness.sh wip/bwd-dq-bulk-reduce wip
#
# Needs the CUTLASS headers in .cutlass/include (as tools/sm90_harness.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
rev=${1:?usage: tools/prebuild_harness.sh REV [NAME]}
sha=$(git rev-parse --short "$rev")
name=${2:-$(echo "$rev" | tr '/' '-')}
tree=build/worktrees/$sha
out=build/prebuilt/$name-$sha
[ -d "$tree" ] || git worktree add --detach "$tree" "$sha" >/dev/null
cmake -S "$tree" -B "$tree/build" -DMAXATTN_BUILD_PYTHON=OFF -DMAXATTN_CUDA=OFF -DMAXATTN_SM90_HARNESS=ON \
  -DCMAKE_BUILD_TYPE=Release -DMAXATTN_CUTLASS_INCLUDE_DIR="$PWD/.cutlass/include" >/dev/null
cmake --build "$tree/build" -j "${JOBS:-$(nproc)}" --target sm90_fwd_harness sm90_bwd_harness
mkdir -p "$out"
cp "$tree/build/tests/cuda/sm90_fwd_harness" "$tree/build/tests/cuda/sm90_bwd_harness" "$out/"
git -C "$tree" log -1 --format='%h %s' > "$out/REVISION"
echo "$out"

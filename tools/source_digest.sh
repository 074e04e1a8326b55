#!/usr/bin/env bash
# Prints a short digest of the tracked sources that a device run builds and runs (csrc/, python/,
# bench/, tests/, CMake files), computed from the files themselves rather than git, so a device
# log can be matched to a local tree: run it here on the commit you sent and compare with the
# "source digest" line of tools/gpu_check.sh's env.log.
set -euo pipefail
cd "$(dirname "$0")/.."
find csrc python bench tests cmake CMakeLists.txt pyproject.toml -type f \
  ! -path '*/__pycache__/*' ! -name '*.pyc' -print0 | LC_ALL=C sort -z | xargs -0 sha1sum | sha1sum | cut -c1-12

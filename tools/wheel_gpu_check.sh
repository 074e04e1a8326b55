#!/usr/bin/env bash
# The wheel stage of tools/gpu_check.sh (device machine, no package index): builds the CUDA 13 wheel
# with tools/build_wheels.sh cuda, installs it into a fresh venv that sees this python's jax, CUDA
# plugin, nvidia-cudnn and pytest (--system-site-packages) but not the source tree, build/gpu_site or
# PYTHONPATH, and from outside the source tree runs python -m maxattn.info (the cudnn backend must be
# available) and tests/python/test_cudnn.py against the installed package.
#
# Usage: tools/wheel_gpu_check.sh LOGDIR
# Env:   PYTHON      base interpreter (default python3)
#        PYTHONPATH  build tools only (scikit-build-core, nanobind, cudnn-frontend, auditwheel, ...,
#                    e.g. /tmp/site from .whl/); unset for everything after the build
#        WHEEL_TEST_TIMEOUT  seconds for the pytest run (default 420)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
log=${1:?usage: $0 LOGDIR}
mkdir -p "$log"; log=$(cd "$log" && pwd)
py=${PYTHON:-python3}
work=/tmp/maxattn-wheel-check  # venv and pytest files: outside the source tree
export PIP_NO_INDEX=1 PIP_DISABLE_PIP_VERSION_CHECK=1  # offline: fail at once instead of retrying
fail() { echo "[wheel] FAILED: $*"; exit 1; }

# 1. Build and repair, without build isolation; auditwheel and patchelf from PYTHONPATH / PATH.
echo "[wheel] build: tools/build_wheels.sh cuda ($("$py" --version), PYTHONPATH=${PYTHONPATH:-})"
t0=$SECONDS
PYTHON="$py" ISOLATION=0 AUDITWHEEL="$py -m auditwheel" OUT="$root/build/wheel-gpu" \
  tools/build_wheels.sh cuda >"$log/build.log" 2>&1 || {
  cp build/wheel-raw/cuda13.log "$log/pip_wheel.log" 2>/dev/null || true
  tail -40 "$log/build.log"; fail "build (logs: $log/build.log, $log/pip_wheel.log)"; }
cp build/wheel-raw/cuda13.log "$log/pip_wheel.log"
whl=$(ls "$root"/build/wheel-gpu/cuda13/maxattn-*manylinux*.whl) || fail "no repaired wheel in build/wheel-gpu/cuda13"
echo "[wheel] built $(basename "$whl") in $((SECONDS - t0)) s"
unset PYTHONPATH

# 2. A fresh venv; pip is the base python's, visible through the system site (no ensurepip needed).
rm -rf "$work"; mkdir -p "$work"
"$py" -m venv --system-site-packages --without-pip "$work/venv"
vpy=$work/venv/bin/python
vsite=$("$vpy" -c 'import sysconfig; print(sysconfig.get_path("purelib"))')
if "$py" -c 'import sys; sys.exit(sys.prefix == sys.base_prefix)'; then
  # $py is itself a venv: the new one's system site is the base interpreter's, so add $py's too.
  "$py" -c 'import site; print("\n".join(site.getsitepackages()))' >"$vsite/_base_site.pth"
fi
t1=$SECONDS  # --ignore-installed: a maxattn elsewhere on the path must not count as installed
"$vpy" -m pip install -q --no-deps --ignore-installed "$whl" 2>&1 | tee "$log/install.log" || fail "pip install into $work/venv"
echo "[wheel] installed into $work/venv in $((SECONDS - t1)) s"

cd "$work"
"$vpy" - "$vsite" "$root" <<'PY' 2>&1 | tee "$log/import.log" || fail "maxattn is not the installed wheel"
import os, sys
site, root = (os.path.realpath(p) for p in sys.argv[1:])
import maxattn, maxattn._src.info as info
for name, f in [("maxattn", maxattn.__file__), ("_maxattn_cuda", info._module_file(info._CUDA_MODULE))]:
    print(f"[wheel] {name}: {f}")
    f = os.path.realpath(f or "(not built)")
    assert f.startswith(site + os.sep) and not f.startswith(root + os.sep), f"{name} not from {site}"
PY

# 3. From outside the source tree: the config report, then the cuDNN tests on the installed package.
"$vpy" -m maxattn.info 2>&1 | tee "$log/info.log" || fail "python -m maxattn.info"
grep -qE '^  cudnn +built: yes, available: yes' "$log/info.log" || fail "cudnn backend not available (see info.log)"

# pytest.ini here: rootdir and ini are $work, so pyproject's pytest settings and the repo root stay
# out; tests/python goes on sys.path (pytest's prepend mode) only for helpers.py. The plugin stops
# the run unless `import maxattn` in the pytest process resolves to the venv.
printf '[pytest]\nmarkers =\n    gpu: needs a CUDA GPU\n    slow: long-running\n' >pytest.ini
cat >wheel_guard.py <<PY
import os, pytest
def pytest_sessionstart(session):
    import maxattn
    print(f"\n[wheel] pytest imports maxattn from {maxattn.__file__}")
    if not os.path.realpath(maxattn.__file__).startswith(os.path.realpath("$vsite") + os.sep):
        pytest.exit("maxattn is not the installed wheel", returncode=1)
PY
echo "[wheel] pytest tests/python/test_cudnn.py (serial, from $work)"
t2=$SECONDS
timeout "${WHEEL_TEST_TIMEOUT:-420}" "$vpy" -m pytest -q -m gpu -rfEs -p no:cacheprovider -p wheel_guard \
    --rootdir "$work" -c "$work/pytest.ini" --junitxml="$log/test.xml" "$root/tests/python/test_cudnn.py" 2>&1 \
  | tee "$log/test.log" || fail "pytest test_cudnn.py (see $log/test.log)"
echo "[wheel] ok: $(basename "$whl"), tests in $((SECONDS - t2)) s; logs in $log"

#!/usr/bin/env bash
# Wheel smoke test (a stage of tools/test.sh): builds the CPU wheel with tools/build_wheels.sh,
# installs it into a fresh venv with NO compiler on PATH (checked: gcc, g++, cc, c++, nvcc must
# not be found), and runs the README's ten-line example, a gradient and max_logit against a
# direct computation, on the cpu backend, from outside the source tree.
# Env: PYTHON (default .venv/bin/python: builds without isolation from its build requirements)
set -euo pipefail
cd "$(dirname "$0")/.."
root=$PWD
py=${PYTHON:-$root/.venv/bin/python}
work=$root/build/wheel-smoke
rm -rf "$work"; mkdir -p "$work"

t0=$SECONDS
PYTHON="$py" ISOLATION=0 OUT="$root/dist" tools/build_wheels.sh cpu
t_build=$((SECONDS - t0))
whl=$(ls "$root"/dist/cpu/maxattn-*manylinux*.whl)

# Fresh venv from the same base interpreter; only the venv's bin on PATH from here on.
base=$("$py" -c 'import sys; print(sys._base_executable)')
"$base" -m venv "$work/venv"
nocc="$work/venv/bin"
t1=$SECONDS
PATH="$nocc" /bin/bash -c '
  for tool in gcc g++ cc c++ nvcc clang; do
    if command -v "$tool" >/dev/null 2>&1; then echo "[wheel-smoke] $tool is on PATH: $(command -v "$tool")"; exit 1; fi
  done
  echo "[wheel-smoke] no compiler on PATH (gcc, g++, cc, c++, nvcc, clang: none found)"
  python -m pip install -q --disable-pip-version-check "$1"' _ "$whl"
t_install=$((SECONDS - t1))

cat >"$work/smoke.py" <<'PY'
import os, sys
import jax, jax.numpy as jnp, numpy as np
import maxattn

assert os.path.realpath(maxattn.__file__).startswith(os.path.realpath(sys.prefix)), maxattn.__file__
import maxattn._maxattn_cpu  # noqa: F401  (the compiled module from the wheel)

# The README's ten lines, on the cpu backend.
B, T, N, K, H = 2, 1024, 8, 2, 64
q = jax.random.normal(jax.random.key(0), (B, T, N, H), jnp.bfloat16)
k = jax.random.normal(jax.random.key(1), (B, T, K, H), jnp.bfloat16)
v = jax.random.normal(jax.random.key(2), (B, T, K, H), jnp.bfloat16)
out, aux = maxattn.dot_product_attention(q, k, v, is_causal=True, return_max_logit=True, return_lse=True,
                                         implementation="cpu")
print(aux["max_logit"])
assert out.shape == (B, T, N, H) and out.dtype == jnp.bfloat16
assert aux["lse"].shape == (B, N, T)

# max_logit against a direct computation (float32, causal, GQA: head n uses kv head n // 4).
q32, k32 = q.astype(np.float32), k.astype(np.float32)
logits = np.einsum("btnh,bsnh->bnts", np.asarray(q32), np.repeat(np.asarray(k32), N // K, axis=2)) / np.sqrt(H)
logits = np.where(np.tril(np.ones((T, T), bool)), logits, -np.inf)
np.testing.assert_allclose(np.asarray(aux["max_logit"]), logits.max(axis=(0, 2, 3)), rtol=1e-3)

# A gradient through the cpu backend against the pure-JAX reference, in float32.
qf, kf, vf = (x[:, :128].astype(jnp.float32) for x in (q, k, v))
loss = lambda impl: lambda q: jnp.sum(maxattn.dot_product_attention(q, kf, vf, is_causal=True,
                                                                      implementation=impl) ** 2)
g_cpu, g_ref = jax.grad(loss("cpu"))(qf), jax.grad(loss("xla"))(qf)
err = float(jnp.linalg.norm(g_cpu - g_ref) / jnp.linalg.norm(g_ref))
assert err <= 1e-5, err

cfg = maxattn._src.info.collect()
assert cfg["backends"]["cpu"]["available"] and not cfg["backends"]["cudnn"]["built"], cfg["backends"]
maxattn.show_config()
print(f"[wheel-smoke] ok: max_logit matches, grad rel err {err:.2e}")
PY
t2=$SECONDS
(cd "$work" && PATH="$nocc" JAX_PLATFORMS=cpu python smoke.py)
t_smoke=$((SECONDS - t2))
echo "[wheel-smoke] $(basename "$whl"): build ${t_build} s, install without compiler ${t_install} s, smoke ${t_smoke} s"

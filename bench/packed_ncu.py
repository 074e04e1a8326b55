"""Device time (Nsight Compute) of one packed call, ragged vs the same work unpacked, kernel by kernel.

  ncu --profile-from-start off --metrics gpu__time_duration.sum --csv python3 bench/packed_ncu.py CALL [B T N H D]

CALL: 0 ragged fwd, 1 unpacked fwd, 2 ragged fwd+bwd, 3 unpacked fwd+bwd (one per process, so the
CSV is that call's kernels).

Only the calls between cuProfilerStart/Stop are profiled (after compiling and warming each).
"""

from __future__ import annotations

import ctypes
import sys

import jax
import jax.numpy as jnp
import numpy as np

import maxattn

CALL = int(sys.argv[1])
B, T, N, H, D = (int(x) for x in (sys.argv[2:] or ["2", "8192", "16", "128", "8"]))
rng = np.random.default_rng(0)
q, k, v, ct = (jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.bfloat16) for _ in range(4))
ids = jnp.asarray(np.repeat(np.arange(1, D + 1, dtype=np.int32), T // D)[None].repeat(B, 0))
unpack = lambda x: x.reshape(B * D, T // D, N, H)


def attn(**kw):
    return lambda q, k, v: maxattn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn",
                                                         return_max_logit=True, return_lse=True, **kw)[0]


def grad(f):
    return jax.jit(jax.grad(lambda q, k, v, ct: jnp.sum(f(q, k, v).astype(jnp.float32) * ct), argnums=(0, 1, 2)))


ragged = attn(q_segment_ids=ids, kv_segment_ids=ids, max_segments_per_row=D)
calls = [("ragged fwd", jax.jit(ragged), (q, k, v)), ("unpacked fwd", jax.jit(attn()), tuple(map(unpack, (q, k, v)))),
         ("ragged fwd+bwd", grad(ragged), (q, k, v, ct.astype(jnp.float32))),
         ("unpacked fwd+bwd", grad(attn()), tuple(map(unpack, (q, k, v))) + (unpack(ct).astype(jnp.float32),))]
name, f, a = calls[CALL]
jax.block_until_ready(f(*a))
jax.block_until_ready(f(*a))
cuda = ctypes.CDLL("libcuda.so.1")
cuda.cuProfilerStart()
jax.block_until_ready(f(*a))
cuda.cuProfilerStop()

"""Many Python threads calling the CPU backend at once give the serial results.

Every call of the C++ backend runs on one process-wide thread pool; several
XLA executions (one per Python thread) share it. Here 16 threads (THREADS)
each run a mix of 12 configurations (different shapes, dtypes, masks, bias,
soft cap; forward with lse/max_logit and the full gradient), ROUNDS times in
shuffled order, and every result must equal the one computed serially
beforehand -- bit for bit, except dbias when the bias is broadcast (its
per-thread partial sums may be added in a different order).

A second test traces and compiles concurrently (first use of fresh
configurations from many threads at once, eager and jit).
"""

from __future__ import annotations

import random
import threading
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import maxattn
from helpers import random_inputs
from maxattn._src.backends import cpu as cpu_backend

pytestmark = pytest.mark.skipif(cpu_backend._maxattn_cpu is None, reason="CPU extension not built")

THREADS = 16
ROUNDS = 4

# (B, T, S, N, K, H, Hv, dtype, kwargs, bias shape or None)
CONFIGS = [
    (1, 7, 9, 2, 1, 8, 8, jnp.float32, {}, None),
    (2, 130, 130, 4, 2, 32, 32, jnp.float32, dict(is_causal=True), None),
    (3, 96, 200, 4, 4, 16, 24, jnp.bfloat16, dict(is_causal=True, causal_alignment="bottom_right"), None),
    (2, 65, 33, 6, 2, 40, 16, jnp.float16, dict(local_window_size=(7, 3)), (1, 6, 65, 33)),
    (2, 50, 50, 4, 1, 16, 16, jnp.float32, dict(logits_soft_cap=5.0), (2, 1, 1, 50)),
    (4, 33, 47, 2, 2, 8, 8, jnp.float32, "padding", None),
    (2, 100, 100, 2, 2, 16, 16, jnp.bfloat16, "segments", None),
    (2, 40, 60, 4, 2, 16, 16, jnp.float32, "mask", (2, 4, 40, 60)),
    (1, 300, 300, 2, 1, 64, 64, jnp.float32, dict(is_causal=True), None),
    (2, 17, 200, 8, 2, 8, 8, jnp.float16, dict(scale=0.5), None),
    (1, 1, 1, 1, 1, 1, 1, jnp.float32, {}, None),
    (2, 97, 129, 4, 2, 72, 64, jnp.bfloat16, dict(is_causal=True, logits_soft_cap=20.0), (1, 4, 97, 129)),
]


def _make(idx):
    B, T, S, N, K, H, Hv, dtype, kw, bias_shape = CONFIGS[idx]
    q, k, v = random_inputs(100 + idx, B, T, S, N, K, H, Hv, dtype)
    rng = np.random.default_rng(idx)
    arrays = {}
    mask = None
    if kw == "padding":
        kw = {}
        arrays = dict(query_seq_lengths=jnp.asarray(rng.integers(0, T + 1, B), jnp.int32),
                      key_value_seq_lengths=jnp.asarray(rng.integers(0, S + 1, B), jnp.int32))
    elif kw == "segments":
        kw = {}
        seg = jnp.asarray(np.sort(rng.integers(0, 4, (B, T)), axis=1), jnp.int32)
        arrays = dict(q_segment_ids=seg, kv_segment_ids=seg)
    elif kw == "mask":
        kw = {}
        mask = jnp.asarray(rng.random((B, 1, T, S)) < 0.6)
    bias = None if bias_shape is None else jnp.asarray(rng.standard_normal(bias_shape), jnp.float32)
    ct = jnp.asarray(rng.standard_normal((B, T, N, Hv)), dtype)

    def run(q, k, v, bias, mask, arrays, ct):
        def f(q, k, v, bias):
            out, aux = maxattn.dot_product_attention(q, k, v, bias, mask, implementation="cpu",
                                                     return_max_logit=True, return_lse=True, **arrays, **kw)
            return jnp.sum(out.astype(jnp.float32) * ct.astype(jnp.float32)), (out, aux)

        argnums = (0, 1, 2, 3) if bias is not None else (0, 1, 2)
        grads, (out, aux) = jax.grad(f, argnums=argnums, has_aux=True)(q, k, v, bias)
        return out, aux["lse"], aux["max_logit"], grads

    args = (q, k, v, bias, mask, arrays, ct)
    return run, args, bias_shape is not None and any(
        d == 1 and full > 1 for d, full in zip(bias_shape, (B, N, T, S)))


def _compare(got, want, broadcast_bias, what):
    out, lse, mx, grads = got
    w_out, w_lse, w_mx, w_grads = want
    np.testing.assert_array_equal(out, w_out, err_msg=f"{what}: out")
    np.testing.assert_array_equal(lse, w_lse, err_msg=f"{what}: lse")
    np.testing.assert_array_equal(mx, w_mx, err_msg=f"{what}: max_logit")
    for i, (g, wg) in enumerate(zip(grads, w_grads)):
        if i == 3 and broadcast_bias:
            np.testing.assert_allclose(g, wg, rtol=1e-5, atol=1e-6, err_msg=f"{what}: dbias")
        else:
            np.testing.assert_array_equal(g, wg, err_msg=f"{what}: grad {i}")


def test_threads_with_different_configs_match_serial():
    cases = [_make(i) for i in range(len(CONFIGS))]
    jitted = [jax.jit(run) for run, _, _ in cases]
    serial = [jax.block_until_ready(f(*args)) for f, (_, args, _) in zip(jitted, cases)]

    work = [i for i in range(len(CONFIGS)) for _ in range(ROUNDS * THREADS // len(CONFIGS) + 1)]
    random.Random(0).shuffle(work)
    barrier = threading.Barrier(THREADS)
    seen_threads = set()

    def worker(tid):
        barrier.wait()  # start together
        seen_threads.add(threading.get_ident())
        done = 0
        for i in work[tid::THREADS]:
            got = jax.block_until_ready(jitted[i](*cases[i][1]))
            _compare(got, serial[i], cases[i][2], f"thread {tid} config {i}")
            done += 1
        return done

    with ThreadPoolExecutor(THREADS) as pool:
        counts = list(pool.map(worker, range(THREADS)))
    assert sum(counts) == len(work) and len(seen_threads) == THREADS


def test_concurrent_first_use_traces_and_compiles_safely():
    """Fresh configurations (new shapes, so new traces and FFI calls) from many threads at once,
    half eager and half jit, each checked against the same call repeated serially afterwards."""
    n = THREADS
    barrier = threading.Barrier(n)
    results = [None] * n

    def call(tid):
        T = 5 + tid  # a shape nobody has used yet
        q, k, v = random_inputs(tid, 2, T, T + 3, 2, 1, 8, 8, jnp.float32)
        f = lambda q, k, v: maxattn.dot_product_attention(
            q, k, v, is_causal=tid % 2 == 0, implementation="cpu", return_max_logit=True, return_lse=True)
        if tid % 4 < 2:
            f = jax.jit(f)
        barrier.wait()
        out, aux = f(q, k, v)
        results[tid] = (q, k, v, jax.block_until_ready((out, aux["lse"], aux["max_logit"])))

    with ThreadPoolExecutor(n) as pool:
        list(pool.map(call, range(n)))
    for tid, (q, k, v, got) in enumerate(results):
        out, aux = maxattn.dot_product_attention(q, k, v, is_causal=tid % 2 == 0, implementation="cpu",
                                                 return_max_logit=True, return_lse=True)
        for a, b in zip(got, (out, aux["lse"], aux["max_logit"])):
            np.testing.assert_array_equal(a, b)

"""Hardening of the cudnn backend, on a CUDA GPU (skipped without one).

* injected cuDNN graph-build and workspace-allocation failures raise a Python
  exception naming the cause, and the next call works;
* concurrent first use of new configurations from many threads builds each
  graph exactly once and gives the serial results bit for bit;
* a tensor with more than 2^31 elements (64-bit indexing) is either computed
  correctly, including rows past element 2^31, or refused with a clear message.

The test hooks live in the CUDA extension `maxattn._maxattn_cuda`:
`_fail_next_graph_builds(n)`, `_fail_next_workspace_allocations(n)` and
`_graph_builds()` (graphs successfully built and cached in this process).
Every test uses shapes that no other test uses, so its graphs are cache misses.
The >2^31 case is marked `slow` (deselect with -m "gpu and not slow").
"""

from __future__ import annotations

import gc
import re
import threading
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import maxattn
from helpers import (GPU_MARKS, MAX_TOL, OUT_TOL, assert_close, assert_max_logit_close, loss_and_grads, random_inputs,
                     reference64, x64)


pytestmark = GPU_MARKS

DT = jnp.bfloat16
TOL = OUT_TOL[DT]
HOOKS = ("_fail_next_graph_builds", "_fail_next_workspace_allocations", "_graph_builds")


def _cuda():
    """The CUDA extension module (imported only here, after the GPU check), with its test hooks."""
    from maxattn._src.backends import cudnn
    module, reason = cudnn.module()
    if module is None:
        pytest.fail(f"the cudnn backend is unavailable on a GPU machine: {reason}")
    missing = [h for h in HOOKS if not hasattr(module, h)]
    if missing:
        pytest.fail(f"maxattn._maxattn_cuda lacks the test hooks {missing}")
    return module


def _fwd(**kw):
    return jax.jit(lambda q, k, v: maxattn.dot_product_attention(q, k, v, implementation="cudnn",
                                                                 return_max_logit=True, **kw))


def _check_fwd(out, aux, q, k, v, **kw):
    B, T, N, Hv = out.shape
    r_out, r_aux, _ = reference64(q, k, v, None, jnp.zeros((B, T, N, Hv)), jnp.zeros((B, N, T)), **kw)
    assert_close(out, r_out, TOL, "out")
    assert_max_logit_close(np.asarray(aux["max_logit"], np.float64), r_aux["max_logit"], MAX_TOL[DT])


# --------------------------------------------------------------------------------------------------
# Failure injection
# --------------------------------------------------------------------------------------------------

def test_injected_graph_build_failure_raises_then_recovers():
    m = _cuda()
    q, k, v = random_inputs(41, 1, 44, 52, 2, 2, 64, 64, DT)  # a configuration no other test uses
    f = _fwd(is_causal=True, causal_alignment="bottom_right")
    before = m._graph_builds()
    m._fail_next_graph_builds(1)
    try:
        with pytest.raises(Exception, match="injected"):
            jax.block_until_ready(f(q, k, v))
        assert m._graph_builds() == before, "a failed build must not be cached"
    finally:
        m._fail_next_graph_builds(0)
    out, aux = jax.block_until_ready(f(q, k, v))
    assert m._graph_builds() == before + 1
    _check_fwd(out, aux, q, k, v, is_causal=True, causal_alignment="bottom_right")
    again, _ = jax.block_until_ready(f(q, k, v))  # now a cache hit
    assert m._graph_builds() == before + 1
    np.testing.assert_array_equal(np.asarray(again, np.float32), np.asarray(out, np.float32))


def test_injected_graph_build_failure_in_backward_raises_then_recovers():
    m = _cuda()
    q, k, v = random_inputs(42, 2, 36, 36, 2, 1, 64, 64, DT)
    rng = np.random.default_rng(43)
    ct_out = jnp.asarray(rng.standard_normal(q.shape[:3] + (v.shape[3],)), jnp.float32)
    ct_lse = jnp.asarray(rng.standard_normal((2, 2, 36)), jnp.float32)
    fn = lambda q, k, v, bias, **kw: maxattn.dot_product_attention(q, k, v, bias, implementation="cudnn", **kw)
    g = jax.jit(lambda *a: loss_and_grads(fn, *a))
    # Build the forward graph first (the same configuration as the forward inside g), so that the
    # injected failure hits the backward graph's build.
    jax.block_until_ready(fn(q, k, v, None, return_max_logit=True, return_lse=True))
    before = m._graph_builds()
    m._fail_next_graph_builds(1)
    try:
        with pytest.raises(Exception, match="injected"):
            jax.block_until_ready(g(q, k, v, None, ct_out, ct_lse))
    finally:
        m._fail_next_graph_builds(0)
    assert m._graph_builds() == before
    out, aux, grads = jax.block_until_ready(g(q, k, v, None, ct_out, ct_lse))
    assert m._graph_builds() >= before + 1
    r_out, r_aux, r_grads = reference64(q, k, v, None, ct_out, ct_lse)
    assert_close(out, r_out, TOL, "out")
    assert_close(aux["lse"], r_aux["lse"], TOL, "lse")
    for name, gr, rg in zip(("dq", "dk", "dv"), grads, r_grads):
        assert_close(np.asarray(gr, np.float32), rg, TOL, name)


def test_injected_workspace_failure_raises_then_recovers():
    m = _cuda()
    q, k, v = random_inputs(44, 1, 60, 60, 2, 2, 64, 64, DT)
    rng = np.random.default_rng(45)
    ct_out = jnp.asarray(rng.standard_normal(q.shape), jnp.float32)
    ct_lse = jnp.asarray(rng.standard_normal((1, 2, 60)), jnp.float32)
    fn = lambda q, k, v, bias, **kw: maxattn.dot_product_attention(q, k, v, bias, implementation="cudnn", **kw)
    g = jax.jit(lambda *a: loss_and_grads(fn, *a, is_causal=True))
    warm = jax.block_until_ready(g(q, k, v, None, ct_out, ct_lse))  # graphs built: only the workspace can fail now
    r_out, r_aux, r_grads = reference64(q, k, v, None, ct_out, ct_lse, is_causal=True)
    for n in (1, 3):
        m._fail_next_workspace_allocations(n)
        try:
            # forward + backward: the backward needs a workspace (dQ accumulation) in any case
            with pytest.raises(Exception, match="injected|scratch allocator"):
                jax.block_until_ready(g(q, k, v, None, ct_out, ct_lse))
        finally:
            m._fail_next_workspace_allocations(0)
        out, aux, grads = jax.block_until_ready(g(q, k, v, None, ct_out, ct_lse))
        np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(warm[0], np.float32))
        assert_close(out, r_out, TOL, "out")
        assert_close(aux["lse"], r_aux["lse"], TOL, "lse")
        assert_max_logit_close(np.asarray(aux["max_logit"], np.float64), r_aux["max_logit"], MAX_TOL[DT])
        for name, gr, rg in zip(("dq", "dk", "dv"), grads, r_grads):
            assert_close(np.asarray(gr, np.float32), rg, TOL, name)


# --------------------------------------------------------------------------------------------------
# Concurrent first use of new configurations
# --------------------------------------------------------------------------------------------------

def test_concurrent_first_use_builds_each_graph_once():
    m = _cuda()
    # (B, T, S): four configurations that no other test uses; forward only, same flags.
    shapes = [(1, 33, 33), (1, 47, 47), (2, 61, 61), (1, 75, 90)]
    N, K, H = 4, 2, 64
    inputs = [jax.block_until_ready(random_inputs(50 + i, B, T, S, N, K, H, H, DT))
              for i, (B, T, S) in enumerate(shapes)]
    f = _fwd(is_causal=True)
    threads = 8
    barrier = threading.Barrier(threads)

    def work(_):
        barrier.wait(timeout=60)
        res = []
        for q, k, v in inputs:  # every thread hits the same new configuration at the same time
            out, aux = f(q, k, v)
            res.append((np.asarray(out, np.float32), np.asarray(aux["max_logit"])))
        return res

    before = m._graph_builds()
    with ThreadPoolExecutor(threads) as pool:
        futures = [pool.submit(work, i) for i in range(threads)]
        results = [fut.result(timeout=300) for fut in futures]
    assert m._graph_builds() == before + len(shapes), "each new configuration must be built exactly once"

    for i, (q, k, v) in enumerate(inputs):
        out, aux = jax.block_until_ready(f(q, k, v))
        serial = (np.asarray(out, np.float32), np.asarray(aux["max_logit"]))
        for t, res in enumerate(results):
            np.testing.assert_array_equal(res[i][0], serial[0], err_msg=f"thread {t}, config {shapes[i]}: out")
            np.testing.assert_array_equal(res[i][1], serial[1], err_msg=f"thread {t}, config {shapes[i]}: max")
        _check_fwd(out, aux, q, k, v, is_causal=True)
    assert m._graph_builds() == before + len(shapes)


# --------------------------------------------------------------------------------------------------
# More than 2^31 elements
# --------------------------------------------------------------------------------------------------

_SIZE_WORDS = re.compile(r"2\^31|2\*\*31|214748364[78]|int32|32-bit|INT_MAX|elements|too large", re.IGNORECASE)


@pytest.mark.slow
def test_large_index_over_2_31_elements():
    B, T, S, N, K, H = 8200, 128, 128, 16, 16, 128
    assert B * T * N * H > 2 ** 31  # 2.15e9 elements, 4.3 GB per bf16 tensor
    spike = 2.0  # q and k rows of all-2 in the LAST batch row: max_logit[n] = spike^2 H / sqrt(H) there

    @jax.jit
    def make(key):
        kq, kk, kv = jax.random.split(key, 3)
        q = jax.random.normal(kq, (B, T, N, H), DT)
        k = jax.random.normal(kk, (B, S, K, H), DT)
        v = jax.random.normal(kv, (B, S, K, H), DT)
        n = jnp.arange(N)
        q = q.at[B - 1, 3 + n, n, :].set(spike)
        k = k.at[B - 1, 10 + n, n, :].set(spike)
        return q, k, v

    q, k, v = jax.block_until_ready(make(jax.random.key(3)))
    # Rows at the start, around and past element 2^31 (row 8192 starts at element 2^31 of q and out).
    rows = np.asarray([0, 1, 4095, 8191, 8192, 8198, 8199])
    assert rows[4] * T * N * H == 2 ** 31
    qs, ks, vs = (np.asarray(x[rows], np.float32) for x in (q, k, v))
    refused = None
    try:
        out, aux = jax.block_until_ready(_fwd()(q, k, v))
        o = np.asarray(out[rows], np.float32)
        mx = np.asarray(aux["max_logit"], np.float64)
        del out, aux
    except Exception as e:  # refusing is allowed, but it must say why
        refused = str(e)
    finally:
        del q, k, v
        gc.collect()
    if refused is not None:
        assert _SIZE_WORDS.search(refused), f"a refusal must name the size limit: {refused}"
        return
    with x64():
        r_out, r_aux = maxattn.reference(*(jnp.asarray(x, jnp.float64) for x in (qs, ks, vs)),
                                         return_max_logit=True)
        r_out, r_max = np.asarray(r_out), np.asarray(r_aux["max_logit"])
    for i, b in enumerate(rows):
        assert_close(o[i], r_out[i], TOL, f"out[{b}]")
    # The spike in row B-1 dominates every head, so the rows' reference max is the global one.
    np.testing.assert_allclose(r_max, spike ** 2 * np.sqrt(H), rtol=1e-6)
    assert_max_logit_close(mx, r_max, MAX_TOL[DT])

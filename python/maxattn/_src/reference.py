"""The readable pure-JAX implementation ("xla"): the test oracle and fallback.

It materialises the [B, N, T, S] logits, so it is O(T*S) in memory; the
semantics are the contract that every backend must match (docs/contract.md and
the comment at the top of csrc/maxattn/attention.h).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from maxattn._src.call import Call


def same_segment(q_segment_ids: jax.Array, kv_segment_ids: jax.Array) -> jax.Array:
    """Boolean [B, 1, T, S]: query and key are in the same segment, and it is not padding (id 0)."""
    qs = q_segment_ids[:, None, :, None]
    ks = kv_segment_ids[:, None, None, :]
    return (qs == ks) & (qs != 0)


def visibility(call: Call, key_offset: jax.Array | int = 0) -> jax.Array:
    """Boolean [B|1, N|1, T, S] array: which (query, key) pairs are visible.

    key_offset: the position of the call's first key in the sequence, for a call that holds one
    block of the keys (its per-key operands sliced, kv_seq_lengths given explicitly)."""
    ops, mask = call.operands, call.options.mask
    B, T, N, _ = ops.query.shape
    S = ops.key.shape[1]
    # Every operand rank 4 (no implicit rank promotion: clean under jax_numpy_rank_promotion="raise").
    i = jnp.arange(T, dtype=jnp.int32).reshape(1, 1, T, 1)
    j = (jnp.arange(S, dtype=jnp.int32) + key_offset).reshape(1, 1, 1, S)
    q_valid = ops.q_seq_lengths if ops.q_seq_lengths is not None else jnp.full((B,), T, jnp.int32)
    kv_valid = ops.kv_seq_lengths if ops.kv_seq_lengths is not None else jnp.full((B,), S, jnp.int32)
    q_valid = q_valid[:, None, None, None]
    kv_valid = kv_valid[:, None, None, None]
    # Diagonal offset: 0 for top-left, kv_valid - q_valid for bottom-right.
    d = kv_valid - q_valid if mask.bottom_right else jnp.zeros_like(q_valid)
    vis = (i < q_valid) & (j < kv_valid)
    if mask.causal:
        vis &= j <= i + d
    if mask.window_left >= 0:
        vis &= j >= i + d - mask.window_left
    if mask.window_right >= 0:
        vis &= j <= i + d + mask.window_right
    if ops.q_segment_ids is not None:
        vis &= same_segment(ops.q_segment_ids, ops.kv_segment_ids)
    if ops.mask is not None:
        vis &= ops.mask
    return vis


_PHILOX_M0, _PHILOX_M1 = 0xD2511F53, 0xCD9E8D57
_PHILOX_W0, _PHILOX_W1 = 0x9E3779B9, 0xBB67AE85


def _mulhilo(m: int, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(high, low) 32-bit words of the 64-bit product m * x, in uint32 arithmetic only."""
    u = jnp.uint32
    x0, x1 = x & u(0xFFFF), x >> u(16)
    m0, m1 = u(m & 0xFFFF), u(m >> 16)
    p00, p01, p10, p11 = x0 * m0, x1 * m0, x0 * m1, x1 * m1
    mid = (p00 >> u(16)) + (p01 & u(0xFFFF)) + (p10 & u(0xFFFF))
    hi = p11 + (p01 >> u(16)) + (p10 >> u(16)) + (mid >> u(16))
    return hi, x * u(m)


def philox4x32_10(c0, c1, c2, c3, k0, k1):
    """Philox4x32-10 (Salmon et al. 2011) on uint32 arrays; as csrc/maxattn/dropout.h."""
    u = jnp.uint32
    for _ in range(10):
        hi0, lo0 = _mulhilo(_PHILOX_M0, c0)
        hi1, lo1 = _mulhilo(_PHILOX_M1, c2)
        c0, c1, c2, c3 = hi1 ^ c1 ^ k0, lo1, hi0 ^ c3 ^ k1, lo0
        k0 = k0 + u(_PHILOX_W0)
        k1 = k1 + u(_PHILOX_W1)
    return c0, c1, c2, c3


def dropout_threshold(rate: float) -> int:
    """keep iff bits >= threshold; the same rounding as DropoutThreshold in dropout.h."""
    t = float(np.float32(rate)) * 2.0 ** 32
    return 0 if not t > 0 else min(int(t), 2 ** 32 - 1)


def dropout_scale(rate: float) -> np.float32:
    """1 / (1 - rate) in float32, as the kernels compute it."""
    return np.float32(1) / (np.float32(1) - np.float32(rate))


def dropout_keep(call: Call, key_offset: jax.Array | int = 0) -> jax.Array:
    """Boolean [B, N, T, S]: keep(b, n, i, j) of csrc/maxattn/dropout.h for the call's dropout seed
    (key_offset as in `visibility`)."""
    ops = call.operands
    B, T, N, _ = ops.query.shape
    S = ops.key.shape[1]
    u = jnp.uint32
    seed = ops.dropout_seed.astype(u)
    b = jnp.arange(B, dtype=u)[:, None, None, None] + seed[2]
    n = jnp.arange(N, dtype=u)[None, :, None, None] + seed[3]
    i = jnp.arange(T, dtype=u)[None, None, :, None]
    j = (jnp.arange(S, dtype=u) + jnp.asarray(key_offset).astype(u))[None, None, None, :]
    shape = (B, N, T, S)
    c0, c1, c2, c3 = (jnp.broadcast_to(x, shape) for x in (j >> u(2), i, n, b))
    words = philox4x32_10(c0, c1, c2, c3, jnp.full(shape, seed[0], u), jnp.full(shape, seed[1], u))
    w = jnp.broadcast_to(j & u(3), shape)
    bits = jnp.where(w == 0, words[0], jnp.where(w == 1, words[1], jnp.where(w == 2, words[2], words[3])))
    return bits >= u(dropout_threshold(call.options.dropout_rate))


def raw_logits(call: Call) -> jax.Array:
    """scale * q.k + bias as [B, N, T, S] in at least float32 (pre-softcap)."""
    ops = call.operands
    q, k = ops.query, ops.key
    N, K = q.shape[2], k.shape[2]
    ct = jnp.promote_types(q.dtype, jnp.float32)
    k = jnp.repeat(k, N // K, axis=2) if K else k
    s = jnp.einsum("btnh,bsnh->bnts", q.astype(ct), k.astype(ct),
                   precision=jax.lax.Precision.HIGHEST) * jnp.asarray(call.options.scale, ct)
    if ops.bias is not None:
        s = s + ops.bias.astype(ct)
    return s


def attention(call: Call) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Returns (out [B,T,N,Hv] input dtype, lse [B,N,T] f32+, max_logit [B,N] f32+).

    max_logit here is per (batch, head); the public API reduces it over B.
    Differentiable by JAX autodiff in query, key, value, bias and
    ops.sink_logits; max_logit carries no gradient. With a sink (softmax_type
    off_by_one / learnable) exp(sink[n]) joins every row's denominator and lse;
    with dropout the normalised probabilities are multiplied by
    keep / (1 - rate) (dropout_keep) before the product with v.
    """
    ops, options = call.operands, call.options
    q, v = ops.query, ops.value
    N, K = q.shape[2], v.shape[2]
    ct = jnp.promote_types(q.dtype, jnp.float32)
    s = raw_logits(call)
    vis = jnp.broadcast_to(visibility(call), s.shape)
    # Invisible entries hold the lowest finite value, never -inf (as jax.nn), so that no
    # intermediate is infinite (clean under jax_debug_infs); results are -inf only where the
    # contract says so (a head or row that sees nothing).
    lowest = jnp.finfo(ct).min

    s_vis = jnp.where(vis, jax.lax.stop_gradient(s), lowest)
    max_logit = jnp.max(s_vis, axis=(2, 3), initial=lowest)
    max_logit = jnp.where(max_logit <= lowest, -jnp.inf, max_logit)
    # NaN propagates explicitly (XLA:CPU's max reduction may drop NaN): the sum of the visible
    # NaN entries is NaN iff there is one, else 0.
    max_logit = max_logit + jnp.sum(jnp.where(vis & jnp.isnan(s_vis), s_vis, 0), axis=(2, 3))

    logits = options.softcap * jnp.tanh(s / options.softcap) if options.softcap else s
    masked = jnp.where(vis, logits, lowest)
    row_max = jax.lax.stop_gradient(jnp.max(masked, axis=-1, keepdims=True, initial=lowest))
    sink = None
    if ops.sink_logits is not None:
        sink = ops.sink_logits.astype(ct)[None, :, None, None]
        row_max = jnp.maximum(row_max, jax.lax.stop_gradient(sink))
    p = jnp.where(vis, jnp.exp(jnp.where(vis, masked - row_max, 0)), 0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    if sink is not None:
        denom = denom + jnp.exp(sink - row_max)
    empty = denom == 0
    safe_denom = jnp.where(empty, jnp.ones_like(denom), denom)
    weights = p / safe_denom
    if options.dropout_rate > 0:
        keep = dropout_keep(call)
        weights = jnp.where(keep, weights * jnp.asarray(dropout_scale(options.dropout_rate), ct), 0)
    v_full = jnp.repeat(v, N // K, axis=2) if K else v
    out = jnp.einsum("bnts,bsnh->btnh", weights, v_full.astype(ct), precision=jax.lax.Precision.HIGHEST)
    lse = jnp.where(empty, -jnp.inf, jnp.log(safe_denom) + row_max)[..., 0]
    return out.astype(q.dtype), lse, max_logit

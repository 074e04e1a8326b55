"""The readable pure-JAX implementation ("xla"): the test oracle and fallback.

It materialises the [B, N, T, S] logits, so it is O(T*S) in memory; the
semantics are the contract that every backend must match (DESIGN.md §1.1 and
the comment at the top of csrc/maxattn/attention.h).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from maxattn._src.config import AttentionConfig, Operands


def visibility(config: AttentionConfig, ops: Operands) -> jax.Array:
    """Boolean [B|1, N|1, T, S] array: which (query, key) pairs are visible."""
    B, T, N, _ = ops.query.shape
    S = ops.key.shape[1]
    i = jnp.arange(T, dtype=jnp.int32)[:, None]
    j = jnp.arange(S, dtype=jnp.int32)[None, :]
    q_valid = ops.q_seq_lengths if config.has_q_seq_lengths else jnp.full((B,), T, jnp.int32)
    kv_valid = ops.kv_seq_lengths if config.has_kv_seq_lengths else jnp.full((B,), S, jnp.int32)
    q_valid = q_valid[:, None, None, None]
    kv_valid = kv_valid[:, None, None, None]
    # Diagonal offset: 0 for top-left, kv_valid - q_valid for bottom-right.
    d = kv_valid - q_valid if config.bottom_right else jnp.zeros_like(q_valid)
    vis = (i < q_valid) & (j < kv_valid)
    if config.is_causal:
        vis &= j <= i + d
    if config.window_left >= 0:
        vis &= j >= i + d - config.window_left
    if config.window_right >= 0:
        vis &= j <= i + d + config.window_right
    if config.has_segment_ids:
        qs = ops.q_segment_ids[:, None, :, None]
        ks = ops.kv_segment_ids[:, None, None, :]
        vis &= (qs == ks) & (qs != 0)
    if config.has_mask:
        vis &= ops.mask
    return vis


def raw_logits(config: AttentionConfig, ops: Operands) -> jax.Array:
    """scale * q.k + bias as [B, N, T, S] in at least float32 (pre-softcap)."""
    q, k = ops.query, ops.key
    N, K = q.shape[2], k.shape[2]
    ct = jnp.promote_types(q.dtype, jnp.float32)
    k = jnp.repeat(k, N // K, axis=2) if K else k
    s = jnp.einsum("btnh,bsnh->bnts", q.astype(ct), k.astype(ct),
                   precision=jax.lax.Precision.HIGHEST) * jnp.asarray(config.scale, ct)
    if config.has_bias:
        s = s + ops.bias.astype(ct)
    return s


def attention(config: AttentionConfig, ops: Operands) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Returns (out [B,T,N,Hv] input dtype, lse [B,N,T] f32+, max_logit [B,N] f32+).

    max_logit here is per (batch, head); the public API reduces it over B.
    Differentiable by JAX autodiff in query, key, value and bias; max_logit
    carries no gradient.
    """
    q, v = ops.query, ops.value
    N, K = q.shape[2], v.shape[2]
    ct = jnp.promote_types(q.dtype, jnp.float32)
    s = raw_logits(config, ops)
    vis = jnp.broadcast_to(visibility(config, ops), s.shape)
    neg_inf = jnp.asarray(-jnp.inf, ct)

    max_logit = jnp.max(jnp.where(vis, jax.lax.stop_gradient(s), neg_inf), axis=(2, 3),
                        initial=-jnp.inf)

    logits = config.softcap * jnp.tanh(s / config.softcap) if config.softcap else s
    masked = jnp.where(vis, logits, neg_inf)
    row_max = jax.lax.stop_gradient(jnp.max(masked, axis=-1, keepdims=True, initial=-jnp.inf))
    row_max = jnp.where(row_max == -jnp.inf, jnp.zeros_like(row_max), row_max)
    p = jnp.where(vis, jnp.exp(masked - row_max), jnp.zeros_like(masked))
    denom = jnp.sum(p, axis=-1, keepdims=True)
    empty = denom == 0
    safe_denom = jnp.where(empty, jnp.ones_like(denom), denom)
    weights = p / safe_denom
    v_full = jnp.repeat(v, N // K, axis=2) if K else v
    out = jnp.einsum("bnts,bsnh->btnh", weights, v_full.astype(ct), precision=jax.lax.Precision.HIGHEST)
    lse = jnp.where(empty, neg_inf, jnp.log(safe_denom) + row_max)[..., 0]
    return out.astype(q.dtype), lse, max_logit

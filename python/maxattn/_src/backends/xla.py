"""The "xla" backend: the pure-JAX reference (reference.py) seen through the backend contract.

Used for `implementation="xla"` under context parallelism and sharding (the
stack's partitioning code serves it like any backend), and by the tests. Its
backward is the flash-attention backward from the given (global) lse and
output, so it can run on a block of keys, like the fused backends.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from maxattn._src import reference
from maxattn._src.call import Call, Fwd, Grads, Saved


class XlaBackend:
    name = "xla"

    def unsupported_reason(self, call: Call) -> Optional[str]:
        return None

    def forward(self, call: Call) -> Fwd:
        out, lse, mx = reference.attention(call)
        f32 = jnp.promote_types(lse.dtype, jnp.float32)
        return Fwd(out, lse.astype(f32) if call.options.lse else None,
                   mx.astype(f32) if call.options.max_logit else None)

    def backward(self, call: Call, saved: Saved) -> Grads:
        ops, options = call.operands, call.options
        q, k, v = ops.query, ops.key, ops.value
        N, K = q.shape[2], k.shape[2]
        G = N // K
        ct = jnp.promote_types(q.dtype, jnp.float32)
        s = reference.raw_logits(call)
        vis = jnp.broadcast_to(reference.visibility(call), s.shape)
        if options.softcap:
            th = jnp.tanh(s / options.softcap)
            logits = options.softcap * th
        else:
            logits = s
        lse_b = saved.lse.astype(ct)[..., None]
        live = vis & ~jnp.isneginf(lse_b)
        p = jnp.where(live, jnp.exp(jnp.where(live, logits - lse_b, 0.0)), 0.0)
        hp = jax.lax.Precision.HIGHEST
        rep = lambda x: jnp.repeat(x, G, axis=2) if G > 1 else x
        do = saved.dout.astype(ct)
        dp = jnp.einsum("btnd,bsnd->bnts", do, rep(v).astype(ct), precision=hp)
        pz = p
        if options.dropout_rate > 0:
            z = jnp.where(reference.dropout_keep(call),
                          jnp.asarray(reference.dropout_scale(options.dropout_rate), ct), 0)
            pz = p * z
            dp = dp * z
        D = jnp.transpose(jnp.sum(do * saved.out.astype(ct), axis=-1), (0, 2, 1))[..., None]
        dd = D if saved.dlse is None else D - saved.dlse.astype(ct)[..., None]
        dsink = None
        if ops.sink_logits is not None:  # per batch row [B, N]
            sink = ops.sink_logits.astype(ct)[None, :, None, None]
            dsink = -jnp.sum(jnp.exp(sink - lse_b) * dd, axis=(2, 3)).astype(jnp.float32)
        ds = p * (dp - dd)
        if options.softcap:
            ds = ds * (1.0 - th * th)
        dq = jnp.einsum("bnts,bsnh->btnh", ds, rep(k).astype(ct), precision=hp) * options.scale
        dk = jnp.einsum("bnts,btnh->bsnh", ds, q.astype(ct), precision=hp) * options.scale
        dv = jnp.einsum("bnts,btnd->bsnd", pz, do, precision=hp)
        B, S = k.shape[0], k.shape[1]
        dk = dk.reshape(B, S, K, G, -1).sum(3)
        dv = dv.reshape(B, S, K, G, -1).sum(3)
        dbias = None
        if ops.bias is not None:
            axes = tuple(i for i in range(4) if ops.bias.shape[i] == 1 and ds.shape[i] != 1)
            dbias = jnp.sum(ds, axis=axes, keepdims=True).reshape(ops.bias.shape).astype(jnp.float32)
        return Grads(dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dbias, dsink)


BACKEND = XlaBackend()

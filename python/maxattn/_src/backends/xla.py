"""The "xla" backend: the pure-JAX reference (reference.py) seen through the backend contract.

Used for `implementation="xla"` under context parallelism and sharding (the
stack's partitioning code serves it like any backend), by the tests, and as
the backward of soft-capped sm90 forwards our backward kernel refuses (the
deterministic mode at head dim 256; cuDNN has no soft cap). Its backward is the flash-attention backward from the given
(global) lse and output, so it can run on a block of keys, like the fused
backends, and it walks the keys in blocks itself: its memory is O(T) per key
block, not the forward's O(T * S).
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from maxattn._src import reference
from maxattn._src.call import Call, Fwd, Grads, Saved


# Keys per step of the backward's scan: [B, N, T, KEY_BLOCK] float32 logits, probabilities and
# gradients live at a time.
KEY_BLOCK = 128


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
        """The flash-attention backward, key block by key block (KEY_BLOCK keys per step of a
        lax.scan): O(B * N * T * KEY_BLOCK) memory instead of the [B, N, T, S] logits, so that
        a call no fused kernel takes (a soft cap where the sm90 backward refuses the call) can
        train at long sequence lengths. dQ is summed over the blocks in float32; dK, dV and dbias are
        per block."""
        ops, options = call.operands, call.options
        q, k, v = ops.query, ops.key, ops.value
        B, T, N, _ = q.shape
        S, K = k.shape[1], k.shape[2]
        G = N // K
        ct = jnp.promote_types(q.dtype, jnp.float32)
        hp = jax.lax.Precision.HIGHEST
        rep = lambda x: jnp.repeat(x, G, axis=2) if G > 1 else x
        do = saved.dout.astype(ct)
        lse_b = saved.lse.astype(ct)[..., None]  # [B, N, T, 1]
        D = jnp.transpose(jnp.sum(do * saved.out.astype(ct), axis=-1), (0, 2, 1))[..., None]
        dd = D if saved.dlse is None else D - saved.dlse.astype(ct)[..., None]
        dsink = None
        if ops.sink_logits is not None:  # per batch row [B, N]
            sink = ops.sink_logits.astype(ct)[None, :, None, None]
            dsink = -jnp.sum(jnp.exp(sink - lse_b) * dd, axis=(2, 3)).astype(jnp.float32)

        # The per-key operands in blocks: padded to a whole number of blocks (padding keys are
        # invisible: past kv_seq_lengths, which is given explicitly for that), block axis first.
        width = max(1, min(S, KEY_BLOCK))  # S = 0: no blocks
        blocks = -(-S // width)
        pad = blocks * width - S

        def split(x, axis, fill):
            """x with the keys on `axis` -> [blocks, ..., width, ...], padded with `fill`."""
            x = jnp.pad(x, [(0, pad) if a == axis else (0, 0) for a in range(x.ndim)], constant_values=fill)
            return jnp.moveaxis(x.reshape(x.shape[:axis] + (blocks, width) + x.shape[axis + 1:]), axis, 0)

        def unsplit(x, axis):
            """The inverse of split: [blocks, ..., width, ...] -> the S keys on `axis`."""
            x = jnp.moveaxis(x, 0, axis)
            x = x.reshape(x.shape[:axis] + (blocks * width,) + x.shape[axis + 2:])
            return jax.lax.slice_in_dim(x, 0, S, axis=axis)

        kv_len = ops.kv_seq_lengths if ops.kv_seq_lengths is not None else jnp.full((B,), S, jnp.int32)
        xs = dict(key=split(k, 1, 0), value=split(v, 1, 0), offset=jnp.arange(blocks, dtype=jnp.int32) * width)
        if ops.kv_segment_ids is not None:
            xs["kv_segment_ids"] = split(ops.kv_segment_ids, 1, 0)  # id 0: padding, never visible
        # bias / mask [b, n, t, s]: split along s unless they broadcast there (s = 1).
        if ops.bias is not None and ops.bias.shape[3] > 1:
            xs["bias"] = split(ops.bias, 3, 0)
        if ops.mask is not None and ops.mask.shape[3] > 1:
            xs["mask"] = split(ops.mask, 3, False)

        def step(dq, x):
            j0 = x["offset"]
            sub = call.replace(kv_seq_lengths=kv_len, **{name: a for name, a in x.items() if name != "offset"})
            kb, vb = sub.operands.key, sub.operands.value
            s = reference.raw_logits(sub)
            vis = jnp.broadcast_to(reference.visibility(sub, j0), s.shape)
            if options.softcap:
                th = jnp.tanh(s / options.softcap)
                logits = options.softcap * th
            else:
                logits = s
            live = vis & ~jnp.isneginf(lse_b)
            p = jnp.where(live, jnp.exp(jnp.where(live, logits - lse_b, 0.0)), 0.0)
            dp = jnp.einsum("btnd,bsnd->bnts", do, rep(vb).astype(ct), precision=hp)
            pz = p
            if options.dropout_rate > 0:
                z = jnp.where(reference.dropout_keep(sub, j0),
                              jnp.asarray(reference.dropout_scale(options.dropout_rate), ct), 0)
                pz = p * z
                dp = dp * z
            ds = p * (dp - dd)
            if options.softcap:
                ds = ds * (1.0 - th * th)
            dq = dq + jnp.einsum("bnts,bsnh->btnh", ds, rep(kb).astype(ct), precision=hp) * options.scale
            dk = jnp.einsum("bnts,btnh->bsnh", ds, q.astype(ct), precision=hp) * options.scale
            dv = jnp.einsum("bnts,btnd->bsnd", pz, do, precision=hp)
            dk = dk.reshape(B, width, K, G, -1).sum(3)
            dv = dv.reshape(B, width, K, G, -1).sum(3)
            dbias = None
            if ops.bias is not None:
                axes = tuple(i for i in range(4) if ops.bias.shape[i] == 1 and ds.shape[i] != 1)
                dbias = jnp.sum(ds, axis=axes, keepdims=True) if axes else ds
            return dq, (dk, dv, dbias)

        dq0 = jnp.zeros(q.shape[:3] + (k.shape[3],), ct)
        dq, (dk, dv, dbias) = jax.lax.scan(step, dq0, xs)
        dk, dv = unsplit(dk, 1), unsplit(dv, 1)
        if dbias is not None:
            # Summed over each block's keys where the bias broadcasts over them: now over the blocks.
            dbias = jnp.sum(dbias, axis=0) if ops.bias.shape[3] == 1 else unsplit(dbias, 3)
            dbias = dbias.reshape(ops.bias.shape).astype(jnp.float32)
        return Grads(dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dbias, dsink)


BACKEND = XlaBackend()

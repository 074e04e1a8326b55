"""Context parallelism by rotating K/V blocks around the cp ring with `ppermute`.

cp - 1 steps; partial outputs are merged through their lse; in the backward
the dK/dV accumulators travel with their K/V block and one more hop after the
last step brings each back to its owner. K/V are never all-gathered.

Causal without padding lengths takes fewer, larger calls. Step 0 holds the
rank's own block: plain top-left causal on the local block (also right for
the dual-chunk layout: local chunk r vs 2cp-1-r is all masked, 2cp-1-r vs r
all visible). Later steps hold the block of src != rank:
  plain layout:  src < rank: fully visible; src > rank: skipped;
  dual-chunk:    src < rank: all local queries see the first kv chunk only;
                 src > rank: only the second query chunk sees, the whole block.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from maxattn._src.call import Call, Fwd, Grads, Saved
from maxattn._src.cp import blocks
from maxattn._src.cp.blocks import WHOLE, half
from maxattn._src.cp.spec import ContextParallel


def _shortcut(call: Call) -> bool:
    ops = call.operands
    return call.options.mask.causal and ops.q_seq_lengths is None and ops.kv_seq_lengths is None


def _block_call(call: Call, causal: bool, q, qseg, k, v, kvseg, q_tag, kv_tag) -> Call:
    options = call.options if causal else call.options.with_mask(causal=False)
    return call.replace(options, query=q, key=k, value=v, q_segment_ids=qseg, kv_segment_ids=kvseg,
                        dropout_seed=blocks.block_seed(call.operands.dropout_seed, q_tag, kv_tag))


def _pad_first_half(x, axis, fill):
    """[.., n, ..] -> [.., 2n, ..] with the first half filled with `fill`."""
    return jnp.concatenate([jnp.full_like(x, fill), x], axis=axis)


def _pad_second_half(x, axis, fill):
    return jnp.concatenate([x, jnp.full_like(x, fill)], axis=axis)


def forward(impl, call: Call, cp: ContextParallel, cp_size: int, rank) -> Fwd:
    """The merged vanilla-softmax forward of the local queries (max_logit not yet reduced over cp)."""
    ops = call.operands
    rot = blocks.rotate(cp, cp_size)
    block = (ops.key, ops.value, ops.kv_segment_ids)
    if not _shortcut(call):
        acc = blocks.PairForward(impl, call, cp, cp_size, rank)
        for step in range(cp_size):
            nxt = rot(block) if step + 1 < cp_size else None
            acc.attend(*block, (rank - step) % cp_size)
            block = nxt
        return acc.result()

    q, qseg = ops.query, ops.q_segment_ids
    Tl = q.shape[1]
    fwd = lambda *a: tuple(impl.forward(_block_call(call, *a)))
    acc = None
    for step in range(cp_size):
        nxt = rot(block) if step + 1 < cp_size else None
        k, v, ks = block
        if step == 0:
            part = fwd(True, q, qseg, k, v, ks, WHOLE + rank, WHOLE + rank)
        else:
            src = (rank - step) % cp_size
            if not cp.load_balanced:
                part = lax.cond(src < rank, lambda: fwd(False, q, qseg, k, v, ks, WHOLE + rank, WHOLE + src),
                                lambda: tuple(blocks.skipped_forward(call, Tl)))
            else:
                def earlier():  # all queries vs the first kv chunk
                    return fwd(False, q, qseg, half(k, 0), half(v, 0), half(ks, 0), WHOLE + rank, src)

                def later():  # the second query chunk vs the whole block
                    o, l, m = fwd(False, half(q, 1), half(qseg, 1), k, v, ks, 2 * cp_size - 1 - rank, WHOLE + src)
                    return (_pad_first_half(o, 1, 0), _pad_first_half(l, 2, -jnp.inf), m)

                part = lax.cond(src < rank, earlier, later)
        acc = blocks.merge(acc, Fwd(*part))
        block = nxt
    return acc


def backward(impl, call: Call, cp: ContextParallel, cp_size: int, rank, saved: Saved) -> Grads:
    ops = call.operands
    rot = blocks.rotate(cp, cp_size)
    block = (ops.key, ops.value, ops.kv_segment_ids)
    dk = dv = None
    if not _shortcut(call):
        acc = blocks.PairBackward(impl, call, cp, cp_size, rank, saved)
        for step in range(cp_size):
            nxt = rot(block) if step + 1 < cp_size else None
            dk_b, dv_b = acc.block_grads(*block, (rank - step) % cp_size)
            dk, dv = blocks.add(dk, dk_b), blocks.add(dv, dv_b)
            # The accumulators travel with their kv block; after the last step one
            # more hop brings each back to its owner.
            dk, dv = rot((dk, dv))
            block = nxt
        return blocks.as_grads(call, acc.result_dq(), dk, dv)

    q, qseg = ops.query, ops.q_segment_ids
    f32 = lambda x: x.astype(jnp.float32)

    def bwd(causal, qq, qs, sv, k, v, ks, q_tag, kv_tag):
        g = impl.backward(_block_call(call, causal, qq, qs, k, v, ks, q_tag, kv_tag), sv)
        return f32(g.dq), f32(g.dk), f32(g.dv)

    second = Saved(half(saved.out, 1), half(saved.lse, 1, 2), half(saved.dout, 1), half(saved.dlse, 1, 2))
    dq = None
    for step in range(cp_size):
        nxt = rot(block) if step + 1 < cp_size else None
        k, v, ks = block
        if step == 0:
            g = bwd(True, q, qseg, saved, k, v, ks, WHOLE + rank, WHOLE + rank)
        else:
            src = (rank - step) % cp_size
            zeros = lambda: (jnp.zeros(q.shape, jnp.float32), jnp.zeros(k.shape, jnp.float32),
                             jnp.zeros(v.shape, jnp.float32))
            if not cp.load_balanced:
                g = lax.cond(src < rank, lambda: bwd(False, q, qseg, saved, k, v, ks, WHOLE + rank, WHOLE + src),
                             zeros)
            else:
                def earlier():
                    dq_, dk_, dv_ = bwd(False, q, qseg, saved, half(k, 0), half(v, 0), half(ks, 0),
                                        WHOLE + rank, src)
                    return dq_, _pad_second_half(dk_, 1, 0), _pad_second_half(dv_, 1, 0)

                def later():
                    dq_, dk_, dv_ = bwd(False, half(q, 1), half(qseg, 1), second, k, v, ks,
                                        2 * cp_size - 1 - rank, WHOLE + src)
                    return _pad_first_half(dq_, 1, 0), dk_, dv_

                g = lax.cond(src < rank, earlier, later)
        dq, dk, dv = blocks.add(dq, g[0]), blocks.add(dk, g[1]), blocks.add(dv, g[2])
        dk, dv = rot((dk, dv))
        block = nxt
    return blocks.as_grads(call, dq, dk, dv)

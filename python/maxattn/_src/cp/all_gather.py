"""Context parallelism by all-gathering K/V over the cp axis.

Each rank attends its local queries to the whole key sequence; in the
backward dK/dV are reduce-scattered back to their owners.

Causal without padding lengths takes a shortcut: a query chunk at global
offset o (size c) against the whole gathered key sequence in natural order is
exactly "bottom-right causal with kv length o + c" (diagonal offset
(o + c) - c = o; keys past o + c are not visible to any of its queries): one
call per query chunk. A backend that refuses that form (cuDNN: with dropout or
segment ids) gets the generic chunk-pair path.
"""

from __future__ import annotations

import jax.numpy as jnp
from jax import lax

from maxattn._src import load_balance
from maxattn._src.call import Alignment, Call, Fwd, Grads, Saved
from maxattn._src.cp import blocks
from maxattn._src.cp.spec import ContextParallel


def _gather(cp: ContextParallel, x):
    return None if x is None else lax.all_gather(x, cp.axis, axis=1, tiled=True)


def _kv_blocks(call: Call, cp: ContextParallel, cp_size: int, split: bool):
    """(k, v, kv segment ids, src, src_is_block) of the gathered sequence: whole or per source rank."""
    ops = call.operands
    kg, vg, sg = (_gather(cp, x) for x in (ops.key, ops.value, ops.kv_segment_ids))
    if not split:
        return [(kg, vg, sg, None, False)]
    Sl = ops.key.shape[1]
    sl = lambda x, src: None if x is None else lax.slice_in_dim(x, src * Sl, (src + 1) * Sl, axis=1)
    return [(sl(kg, src), sl(vg, src), sl(sg, src), src, True) for src in range(cp_size)]


# ----------------------------------------------------------------------------
# The causal shortcut.


def _chunk_calls(call: Call, cp: ContextParallel, cp_size: int, rank):
    """(call, query piece) for each local query chunk vs the natural-order gathered K/V."""
    ops = call.operands
    natural = lambda x: None if x is None else (
        load_balance.inverse_reorder_for_load_balancing(_gather(cp, x), cp_size, 1) if cp.load_balanced
        else _gather(cp, x))
    kn, vn, sn = natural(ops.key), natural(ops.value), natural(ops.kv_segment_ids)
    options = call.options.with_mask(alignment=Alignment.BOTTOM_RIGHT)
    calls = []
    for qp in blocks.pieces(ops.query.shape[1], rank, cp_size, cp, split=True):
        kvlen = jnp.broadcast_to(jnp.asarray(qp.offset + qp.size, jnp.int32), (ops.query.shape[0],))
        chunk = call.replace(options, query=blocks.seq_slice(ops.query, qp, 1), key=kn, value=vn,
                             kv_seq_lengths=kvlen, q_segment_ids=blocks.seq_slice(ops.q_segment_ids, qp, 1),
                             kv_segment_ids=sn, dropout_seed=blocks.block_seed(ops.dropout_seed, qp.chunk,
                                                                               blocks.GATHERED))
        calls.append((chunk, qp))
    return calls


def _shortcut(impl, call: Call) -> bool:
    """Causal without lengths, and the backend runs the shortcut's bottom-right form."""
    ops = call.operands
    if not call.options.mask.causal or ops.q_seq_lengths is not None or ops.kv_seq_lengths is not None:
        return False
    probe = call.replace(call.options.with_mask(alignment=Alignment.BOTTOM_RIGHT),
                         kv_seq_lengths=jnp.zeros((ops.query.shape[0],), jnp.int32))
    return impl.unsupported_reason(probe) is None


# ----------------------------------------------------------------------------


def forward(impl, call: Call, cp: ContextParallel, cp_size: int, rank) -> Fwd:
    """The merged vanilla-softmax forward of the local queries (max_logit not yet reduced over cp)."""
    if _shortcut(impl, call):
        parts = [impl.forward(c) for c, _ in _chunk_calls(call, cp, cp_size, rank)]
        return Fwd(blocks.concat([p.out for p in parts], 1), blocks.concat([p.lse for p in parts], 2),
                   blocks.max_of(p.max_logit for p in parts) if call.options.max_logit else None)
    acc = blocks.PairForward(impl, call, cp, cp_size, rank)
    for block in _kv_blocks(call, cp, cp_size, acc.split_kv):
        acc.attend(*block)
    return acc.result()


def backward(impl, call: Call, cp: ContextParallel, cp_size: int, rank, saved: Saved) -> Grads:
    if _shortcut(impl, call):
        dqs, dk, dv = [], None, None
        for c, qp in _chunk_calls(call, cp, cp_size, rank):
            g = impl.backward(c, blocks.slice_saved(saved, qp))
            dqs.append(g.dq)
            dk, dv = blocks.add(dk, g.dk.astype(jnp.float32)), blocks.add(dv, g.dv.astype(jnp.float32))
        if cp.load_balanced:
            dk, dv = (load_balance.reorder_for_load_balancing(x, cp_size, 1) for x in (dk, dv))
        dq = blocks.concat(dqs, 1)
    else:
        acc = blocks.PairBackward(impl, call, cp, cp_size, rank, saved)
        dks, dvs = zip(*(acc.block_grads(*block) for block in _kv_blocks(call, cp, cp_size, acc.fwd.split_kv)))
        dk, dv = blocks.concat(list(dks), 1), blocks.concat(list(dvs), 1)
        dq = acc.result_dq()
    dk = lax.psum_scatter(dk, cp.axis, scatter_dimension=1, tiled=True)
    dv = lax.psum_scatter(dv, cp.axis, scatter_dimension=1, tiled=True)
    return blocks.as_grads(call, dq, dk, dv)

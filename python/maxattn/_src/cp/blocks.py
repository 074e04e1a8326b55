"""What every context-parallel strategy shares: block calls, their merge, sinks and seeds.

A strategy (all_gather.py, ring.py) decides which key/value blocks a rank
sees and when; this module turns a (query piece, key piece) pair into one
backend call, merges partial results through their lse, and accumulates
gradients. All of it runs per device inside the partitioner's lowering.

Causal masks are decomposed into chunk pairs: a key chunk before the query
chunk is fully visible (non-causal call), the same chunk uses the causal
kernel, a later chunk is skipped (lse -inf / max_logit -inf, zero gradients).
Padding lengths are shifted per chunk; kv segment ids travel with K/V.

Dropout: every block call gets its own Philox key, the given key with words
0 and 1 xor-ed with bijective hashes of tags of the call's query and key
blocks (global chunk index, or "whole local block of rank r", or "whole
gathered sequence"); forward and backward derive the same key for a block.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Optional

import jax.numpy as jnp
from jax import lax

from maxattn._src.call import Call, Fwd, Grads, Operands, Options, Saved, SoftmaxType
from maxattn._src.cp.spec import ContextParallel

# ----------------------------------------------------------------------------
# Options of the block calls; sinks.


def block_options(options: Options, max_logit: bool) -> Options:
    """Every block call runs the vanilla softmax (the sink is applied after the
    merge) and returns its lse (for the merge) and max_logit per batch row (the
    partitioner reduces the merged rows)."""
    # A (query block, key block) pair is not a ragged layout of the rows'
    # segments: block calls use the dense segment-id rule (max_segments = 0).
    return options.replace(softmax=SoftmaxType.VANILLA, lse=True, max_logit=max_logit, max_logit_over_batch=False,
                           max_segments=0)


def apply_sink(out, lse, sink):
    """Adds the sink to the merged vanilla (out f32 [B,t,N,Hv], lse [B,N,t]) of every row."""
    s = sink.astype(jnp.float32)[None, :, None]
    lse_f = jnp.logaddexp(lse, s)
    dead = jnp.isneginf(lse_f)  # only with a -inf sink and no visible key
    w = jnp.where(dead, 0.0, jnp.exp(lse - jnp.where(dead, 0.0, lse_f)))
    return out.astype(jnp.float32) * jnp.transpose(w, (0, 2, 1))[..., None], lse_f


def sink_grad(sink, saved: Saved):
    """Per batch row dsink [B, N] of the local query rows (from the final out and lse)."""
    f32 = jnp.float32
    dd = jnp.transpose(jnp.sum(saved.dout.astype(f32) * saved.out.astype(f32), axis=-1), (0, 2, 1))
    if saved.dlse is not None:
        dd = dd - saved.dlse.astype(f32)
    lse = saved.lse
    live = ~jnp.isneginf(lse)
    p = jnp.where(live, jnp.exp(sink.astype(f32)[None, :, None] - jnp.where(live, lse, 0.0)), 0.0)
    return -jnp.sum(jnp.where(live, p * dd, 0.0), axis=2)


# ----------------------------------------------------------------------------
# Dropout tags of a block call's query / key ranges (all < 2^32, distinct kinds):
# a global chunk index c -> c; the whole local block of rank r -> WHOLE + r;
# the whole gathered key sequence -> GATHERED.
WHOLE = 1 << 20
GATHERED = 1 << 21


def _fmix32(h):
    """MurmurHash3's 32-bit finaliser (a bijection of uint32)."""
    u = jnp.uint32
    h = h ^ (h >> u(16))
    h = h * u(0x85EBCA6B)
    h = h ^ (h >> u(13))
    h = h * u(0xC2B2AE35)
    return h ^ (h >> u(16))


def block_seed(seed, q_tag, kv_tag):
    """The dropout seed of one block call: key words 0 / 1 xor-ed with bijective hashes of
    the query / key tags, so distinct (query, key) blocks get distinct Philox keys.
    Words 2, 3 (the batch / head offsets of the shard) are kept. None without dropout."""
    if seed is None:
        return None
    u = jnp.uint32
    qt = jnp.asarray(q_tag).astype(u)
    kt = jnp.asarray(kv_tag).astype(u)
    w0 = seed[0] ^ _fmix32(qt * u(0x9E3779B1) + u(0x7F4A7C15))
    w1 = seed[1] ^ _fmix32(kt * u(0x85EBCA77) + u(0x165667B1))
    return jnp.stack([w0, w1, seed[2], seed[3]]).astype(u)


# ----------------------------------------------------------------------------
# Pieces of the local sequence.


@dataclasses.dataclass
class Piece:
    start: int            # local start index
    size: int
    chunk: object         # global chunk id (int or traced scalar), None for "whole local block"
    offset: object        # global position of the piece's first element (None if not needed)

    def q_tag(self, rank):
        return WHOLE + rank if self.chunk is None else self.chunk

    def kv_tag(self, src):
        if self.chunk is not None:
            return self.chunk
        return GATHERED if src is None else WHOLE + src


def pieces(n_local, rank, cp_size, cp: ContextParallel, split: bool) -> list[Piece]:
    """Splits a rank's local sequence block of length n_local into pieces."""
    per = 2 if cp.load_balanced else 1
    c = n_local // per
    ids = [rank, 2 * cp_size - 1 - rank] if cp.load_balanced else [rank]
    if split or per == 1:
        return [Piece(i * c, c, ids[i], ids[i] * c) for i in range(per)]
    return [Piece(0, n_local, None, None)]


def seq_slice(x, piece: Piece, axis):
    if x is None or (piece.start == 0 and piece.size == x.shape[axis]):
        return x
    return lax.slice_in_dim(x, piece.start, piece.start + piece.size, axis=axis)


def half(x, which, axis=1):
    if x is None:
        return None
    n = x.shape[axis] // 2
    return lax.slice_in_dim(x, which * n, (which + 1) * n, axis=axis)


def concat(xs, axis):
    return jnp.concatenate(xs, axis=axis) if len(xs) > 1 else xs[0]


def _local_lengths(lengths, piece: Piece):
    if lengths is None:
        return None
    off = 0 if piece.offset is None else piece.offset
    return jnp.clip(lengths - off, 0, piece.size).astype(jnp.int32)


def needs_split(call: Call, cp: ContextParallel, lengths) -> bool:
    return call.options.mask.causal or (cp.load_balanced and lengths is not None)


def pair_call(call: Call, qp: Piece, kvp: Piece, k, v, kvseg, seed) -> Call:
    ops = call.operands
    return Call(call.options, Operands(
        seq_slice(ops.query, qp, 1), seq_slice(k, kvp, 1), seq_slice(v, kvp, 1), None, None,
        _local_lengths(ops.q_seq_lengths, qp), _local_lengths(ops.kv_seq_lengths, kvp),
        seq_slice(ops.q_segment_ids, qp, 1), seq_slice(kvseg, kvp, 1), None, seed))


def slice_saved(saved: Saved, qp: Piece) -> Saved:
    return Saved(seq_slice(saved.out, qp, 1), seq_slice(saved.lse, qp, 2), seq_slice(saved.dout, qp, 1),
                 seq_slice(saved.dlse, qp, 2))


def _branch_index(qp: Piece, kvp: Piece):
    """0: fully visible, 1: diagonal (causal kernel), 2: fully masked."""
    qid, kid = jnp.asarray(qp.chunk, jnp.int32), jnp.asarray(kvp.chunk, jnp.int32)
    return jnp.where(kid < qid, 0, jnp.where(kid == qid, 1, 2)).astype(jnp.int32)


def unmasked(call: Call) -> Call:
    """The same call without the causal mask (a fully visible block)."""
    return call.replace(options=call.options.with_mask(causal=False))


def skipped_forward(call: Call, t: int) -> Fwd:
    """The result of a fully masked block of t query rows."""
    q, v = call.operands.query, call.operands.value
    B, N = q.shape[0], q.shape[2]
    return Fwd(jnp.zeros((B, t, N, v.shape[3]), q.dtype), jnp.full((B, N, t), -jnp.inf, jnp.float32),
               jnp.full((B, N), -jnp.inf, jnp.float32) if call.options.max_logit else None)


def merge(acc: Optional[Fwd], part: Fwd) -> Fwd:
    """Merges (out f32 [B,t,N,Hv], lse [B,N,t], max_logit) partials through the lse."""
    if acc is None:
        return Fwd(part.out.astype(jnp.float32), part.lse, part.max_logit)
    l1, l2 = acc.lse, part.lse
    hi = jnp.maximum(l1, l2)
    safe = jnp.where(jnp.isneginf(hi), 0.0, hi)
    w1, w2 = jnp.exp(l1 - safe), jnp.exp(l2 - safe)
    tot = w1 + w2
    lse = jnp.where(tot > 0, safe + jnp.log(jnp.where(tot > 0, tot, 1.0)), -jnp.inf)
    denom = jnp.where(tot > 0, tot, 1.0)
    a1 = jnp.transpose(w1 / denom, (0, 2, 1))[..., None]
    a2 = jnp.transpose(w2 / denom, (0, 2, 1))[..., None]
    out = a1 * acc.out + a2 * part.out.astype(jnp.float32)
    mx = None if acc.max_logit is None else jnp.maximum(acc.max_logit, part.max_logit)
    return Fwd(out, lse, mx)


def max_of(values):
    mx = None
    for m in values:
        mx = m if mx is None else jnp.maximum(mx, m)
    return mx


# ----------------------------------------------------------------------------
# The chunk-pair engine: one backend call per (query piece, key piece).


class PairForward:
    """Accumulates the merged forward of the local query pieces over key blocks."""

    def __init__(self, impl, call: Call, cp: ContextParallel, cp_size: int, rank):
        self.impl, self.call, self.cp, self.cp_size, self.rank = impl, call, cp, cp_size, rank
        ops = call.operands
        self.qpieces = pieces(ops.query.shape[1], rank, cp_size, cp, needs_split(call, cp, ops.q_seq_lengths))
        for qp in self.qpieces:
            if qp.chunk is None and not cp.load_balanced:
                qp.offset = rank * ops.query.shape[1]
        self.split_kv = needs_split(call, cp, ops.kv_seq_lengths)
        self.acc: list[Optional[Fwd]] = [None] * len(self.qpieces)

    def kv_pieces(self, n, src, src_is_block: bool) -> list[Piece]:
        if not src_is_block:
            return [Piece(0, n, None, None)]
        kvps = pieces(n, src, self.cp_size, self.cp, self.split_kv)
        for kvp in kvps:
            if kvp.chunk is None and not self.cp.load_balanced:
                kvp.offset = src * n
        return kvps

    def _pair(self, pair: Call, qp: Piece, kvp: Piece) -> Fwd:
        impl = self.impl
        if not pair.options.mask.causal:
            return impl.forward(pair)
        t = pair.operands.query.shape[1]
        return Fwd(*lax.switch(_branch_index(qp, kvp), [
            lambda: tuple(impl.forward(unmasked(pair))),
            lambda: tuple(impl.forward(pair)),
            lambda: tuple(skipped_forward(pair, t))]))

    def attend(self, k, v, kvseg, src, src_is_block: bool = True) -> None:
        seed = self.call.operands.dropout_seed
        for kvp in self.kv_pieces(k.shape[1], src, src_is_block):
            for i, qp in enumerate(self.qpieces):
                pair = pair_call(self.call, qp, kvp, k, v, kvseg,
                                 block_seed(seed, qp.q_tag(self.rank), kvp.kv_tag(src)))
                self.acc[i] = merge(self.acc[i], self._pair(pair, qp, kvp))

    def result(self) -> Fwd:
        return Fwd(concat([a.out for a in self.acc], 1), concat([a.lse for a in self.acc], 2),
                   max_of(a.max_logit for a in self.acc) if self.call.options.max_logit else None)


class PairBackward:
    """Accumulates dq of the local query pieces; returns (dk, dv) f32 per key block."""

    def __init__(self, impl, call: Call, cp: ContextParallel, cp_size: int, rank, saved: Saved):
        self.fwd = PairForward(impl, call, cp, cp_size, rank)  # the same pieces and offsets
        self.saved = saved
        self.dq: list = [None] * len(self.fwd.qpieces)

    def _pair(self, pair: Call, saved: Saved, qp: Piece, kvp: Piece):
        impl = self.fwd.impl

        def grads(c: Call):
            g = impl.backward(c, saved)
            return g.dq.astype(jnp.float32), g.dk.astype(jnp.float32), g.dv.astype(jnp.float32)

        if not pair.options.mask.causal:
            return grads(pair)
        o = pair.operands
        zeros = lambda: (jnp.zeros(o.query.shape, jnp.float32), jnp.zeros(o.key.shape, jnp.float32),
                         jnp.zeros(o.value.shape, jnp.float32))
        return lax.switch(_branch_index(qp, kvp), [lambda: grads(unmasked(pair)), lambda: grads(pair), zeros])

    def block_grads(self, k, v, kvseg, src, src_is_block: bool = True):
        f = self.fwd
        seed = f.call.operands.dropout_seed
        dks, dvs = [], []
        for kvp in f.kv_pieces(k.shape[1], src, src_is_block):
            dk = dv = None
            for i, qp in enumerate(f.qpieces):
                pair = pair_call(f.call, qp, kvp, k, v, kvseg, block_seed(seed, qp.q_tag(f.rank), kvp.kv_tag(src)))
                g = self._pair(pair, slice_saved(self.saved, qp), qp, kvp)
                self.dq[i] = add(self.dq[i], g[0])
                dk, dv = add(dk, g[1]), add(dv, g[2])
            dks.append(dk)
            dvs.append(dv)
        return concat(dks, 1), concat(dvs, 1)

    def result_dq(self):
        return concat(self.dq, 1)


def add(a, b):
    return b if a is None else a + b


def rotate(cp: ContextParallel, cp_size: int) -> Callable:
    """ppermute of a tuple of arrays (None kept) one step around the cp ring."""
    perm = [(i, (i + 1) % cp_size) for i in range(cp_size)]
    return lambda xs: tuple(None if x is None else lax.ppermute(x, cp.axis, perm) for x in xs)


def as_grads(call: Call, dq, dk, dv) -> Grads:
    ops = call.operands
    return Grads(dq.astype(ops.query.dtype), dk.astype(ops.key.dtype), dv.astype(ops.value.dtype))

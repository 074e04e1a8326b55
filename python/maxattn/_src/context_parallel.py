"""Context parallelism (sequence sharding) for the fused attention primitives.

Two strategies, selected by `dot_product_attention(..., context_parallel=...)`:

* ``"all_gather"``: K/V (and kv segment ids) are all-gathered over the cp mesh
  axis; each rank attends its local queries to the whole key sequence; in the
  backward dK/dV are reduce-scattered back.
* ``"ring"``: K/V blocks travel around the cp ranks with `ppermute` (cp-1
  steps); partial outputs are merged through their lse; in the backward the
  dK/dV accumulators travel with the K/V blocks and end at their owner.

Both run inside the `custom_partitioning` lowering of maxattn._src.sharding
(so they see per-device blocks and may use collectives over mesh axis names),
and both call the backend's per-block forward/backward, which is how the same
code serves the cpu, cudnn and xla backends.

Masks: none or causal (top-left, T == S). Causal is decomposed into chunk
pairs: a key chunk before the query chunk is fully visible (non-causal call),
the same chunk uses the causal kernel, a later chunk is skipped (it
contributes lse -inf / max_logit -inf and zero gradients). Padding lengths and
segment ids are supported by both strategies (lengths are shifted per chunk;
kv segment ids travel with K/V), and so are dropout and attention sinks
(below). Not supported: bias, boolean mask, sliding window, bottom-right
causal alignment (ValueError at trace time).

The backward of every block uses the *global* lse and output of its query
rows (flash-attention backward), so the per-block gradients sum to the exact
gradient.

Attention sinks (softmax_type "off_by_one" / "learnable"): every block runs
the vanilla softmax; after the lse merge the sink joins each query row once:
lse' = logaddexp(lse, sink[n]), out' = out * exp(lse - lse') (a row with no
visible key gets lse' = sink[n] and output 0); max_logit excludes the sink
anyway. The backward blocks are again vanilla: with the final (out', lse')
their probabilities exp(s - lse') are the sink-softmax ones, so dq/dk/dv are
exact; dsink[b, n] = -sum_i exp(sink[n] - lse'_i) * (<dout_i, out'_i> - dlse_i)
is computed from the local rows and psum-ed over the cp axis (then, like
without CP, it is per batch row and the caller sums over the batch).

Dropout: every block call gets its own Philox key, the given key with words
0 and 1 xor-ed with bijective hashes of tags of the call's query and key
blocks (global chunk index, or "whole local block of rank r", or "whole
gathered sequence"); forward and backward derive the same key for a block.
So the masks under CP are independent per block and reproducible for a key,
mesh and CP configuration (strategy, load balancing, masking), but they are
not the unsharded call's mask (the kernels index the mask by the call's
local positions), and the "cpu"/"xla" masks still agree with each other.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

import jax.numpy as jnp
from jax import lax

from maxattn._src.config import AttentionConfig, Operands

STRATEGIES = ("all_gather", "ring")


@dataclasses.dataclass(frozen=True)
class ContextParallel:
    """Static description of the requested context parallelism."""

    strategy: str
    axis: str
    load_balanced: bool


def pmax_nan(x, axis):
    """`lax.pmax` that propagates NaN: a collective max need not, and max_logit must."""
    any_nan = lax.pmax(jnp.isnan(x).astype(jnp.int32), axis) > 0
    return jnp.where(any_nan, jnp.nan, lax.pmax(x, axis))


def make_spec(context_parallel, context_parallel_axis, load_balanced) -> Optional[ContextParallel]:
    """Validates the public CP arguments; None when CP is not requested."""
    if not isinstance(load_balanced, bool):
        raise TypeError(f"`load_balanced` must be a Python bool, got {type(load_balanced).__name__}")
    if context_parallel is None:
        if context_parallel_axis is not None:
            raise ValueError("`context_parallel_axis` was given but `context_parallel` is None; "
                             f"pass context_parallel={STRATEGIES[0]!r} or {STRATEGIES[1]!r}")
        if load_balanced:
            raise ValueError("`load_balanced=True` requires `context_parallel` ('all_gather' or 'ring')")
        return None
    if context_parallel not in STRATEGIES:
        raise ValueError(f"`context_parallel` must be None, 'all_gather' or 'ring', got {context_parallel!r}")
    if not isinstance(context_parallel_axis, str) or not context_parallel_axis:
        raise ValueError("`context_parallel_axis` must name the mesh axis that shards the sequence "
                         f"(a non-empty str) when `context_parallel` is set, got {context_parallel_axis!r}")
    return ContextParallel(context_parallel, context_parallel_axis, load_balanced)


def check_supported(cp: ContextParallel, config: AttentionConfig, ops: Operands) -> None:
    """Raises ValueError for the configurations context parallelism cannot run."""
    what = f"context_parallel={cp.strategy!r}"
    if config.has_bias:
        raise ValueError(f"{what} does not support `bias` (only no mask or causal, with optional "
                         "padding lengths / segment ids)")
    if config.has_mask:
        raise ValueError(f"{what} does not support a boolean `mask`; use is_causal, sequence lengths or "
                         "segment ids")
    if config.window_left >= 0 or config.window_right >= 0:
        raise ValueError(f"{what} does not support `local_window_size`")
    if config.is_causal and config.bottom_right:
        raise ValueError(f"{what} supports only causal_alignment='top_left'")
    T, S = ops.query.shape[1], ops.key.shape[1]
    if config.is_causal and T != S:
        raise ValueError(f"{what} with is_causal=True requires equal query and key lengths, got T={T}, S={S}")


def check_sizes(cp: ContextParallel, cp_size: int, T: int, S: int) -> None:
    per = 2 * cp_size if cp.load_balanced else cp_size
    for name, n in (("query", T), ("key/value", S)):
        if n % per:
            raise ValueError(f"context_parallel: the {name} sequence length {n} must be divisible by "
                             f"{'2 * ' if cp.load_balanced else ''}the size {cp_size} of mesh axis "
                             f"{cp.axis!r} (= {per})")


# ----------------------------------------------------------------------------
# Sinks and dropout: what the block calls see.


def _block_config(config: AttentionConfig) -> AttentionConfig:
    """The config of every block call: the vanilla softmax (the sink is applied after the merge)."""
    if config.softmax_type == "vanilla":
        return config
    return dataclasses.replace(config, softmax_type="vanilla")


# Dropout tags of a block call's query / key ranges (all < 2^32, distinct kinds):
# a global chunk index c -> c; the whole local block of rank r -> _WHOLE + r;
# the whole gathered key sequence -> _GATHERED.
_WHOLE = 1 << 20
_GATHERED = 1 << 21


def _fmix32(h):
    """MurmurHash3's 32-bit finaliser (a bijection of uint32)."""
    u = jnp.uint32
    h = h ^ (h >> u(16))
    h = h * u(0x85EBCA6B)
    h = h ^ (h >> u(13))
    h = h * u(0xC2B2AE35)
    return h ^ (h >> u(16))


def _block_seed(seed, q_tag, kv_tag):
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


def _q_tag(piece, rank):
    return _WHOLE + rank if piece.chunk is None else piece.chunk


def _kv_tag(piece, src):
    if piece.chunk is not None:
        return piece.chunk
    return _GATHERED if src is None else _WHOLE + src


def _apply_sink(out, lse, sink):
    """Adds the sink to the merged vanilla (out f32 [B,t,N,Hv], lse [B,N,t]) of every row."""
    s = sink.astype(jnp.float32)[None, :, None]
    lse_f = jnp.logaddexp(lse, s)
    dead = jnp.isneginf(lse_f)  # only with a -inf sink and no visible key
    w = jnp.where(dead, 0.0, jnp.exp(lse - jnp.where(dead, 0.0, lse_f)))
    return out.astype(jnp.float32) * jnp.transpose(w, (0, 2, 1))[..., None], lse_f


def _sink_grad(sink, out, lse, dout, dlse):
    """Per batch row dsink [B, N] of the local query rows (from the final out and lse)."""
    f32 = jnp.float32
    dd = jnp.transpose(jnp.sum(dout.astype(f32) * out.astype(f32), axis=-1), (0, 2, 1))
    if dlse is not None:
        dd = dd - dlse.astype(f32)
    live = ~jnp.isneginf(lse)
    p = jnp.where(live, jnp.exp(sink.astype(f32)[None, :, None] - jnp.where(live, lse, 0.0)), 0.0)
    return -jnp.sum(jnp.where(live, p * dd, 0.0), axis=2)


# ----------------------------------------------------------------------------
# Pieces of the local sequence.


@dataclasses.dataclass
class _Piece:
    start: int            # local start index
    size: int
    chunk: object         # global chunk id (int or traced scalar), None for "whole local block"
    offset: object        # global position of the piece's first element (None if not needed)


def _chunk_ids(rank, cp_size, load_balanced):
    if load_balanced:
        return [rank, 2 * cp_size - 1 - rank]
    return [rank]


def _pieces(n_local, rank, cp_size, cp: ContextParallel, split: bool):
    """Splits a rank's local sequence block of length n_local into pieces."""
    per = 2 if cp.load_balanced else 1
    c = n_local // per
    ids = _chunk_ids(rank, cp_size, cp.load_balanced)
    if split or per == 1:
        return [_Piece(i * c, c, ids[i], ids[i] * c) for i in range(per)]
    return [_Piece(0, n_local, None, None)]


def _seq_slice(x, piece, axis):
    if x is None or (piece.start == 0 and piece.size == x.shape[axis]):
        return x
    return lax.slice_in_dim(x, piece.start, piece.start + piece.size, axis=axis)


def _local_lengths(lengths, piece):
    if lengths is None:
        return None
    off = 0 if piece.offset is None else piece.offset
    return jnp.clip(lengths - off, 0, piece.size).astype(jnp.int32)


def _needs_split(config: AttentionConfig, cp: ContextParallel, has_len: bool) -> bool:
    return config.is_causal or (cp.load_balanced and has_len)


def _pair_ops(ops: Operands, qp: _Piece, kvp: _Piece, k, v, kvseg, seed=None) -> Operands:
    return Operands(
        _seq_slice(ops.query, qp, 1), _seq_slice(k, kvp, 1), _seq_slice(v, kvp, 1), None, None,
        _local_lengths(ops.q_seq_lengths, qp), _local_lengths(ops.kv_seq_lengths, kvp),
        _seq_slice(ops.q_segment_ids, qp, 1), _seq_slice(kvseg, kvp, 1), None, seed)


def _branch_index(qp: _Piece, kvp: _Piece):
    """0: fully visible, 1: diagonal (causal kernel), 2: fully masked."""
    qid, kid = jnp.asarray(qp.chunk, jnp.int32), jnp.asarray(kvp.chunk, jnp.int32)
    return jnp.where(kid < qid, 0, jnp.where(kid == qid, 1, 2)).astype(jnp.int32)


def _merge(acc, part):
    """Merges (out f32 [B,t,N,Hv], lse [B,N,t], mx) partials through the lse."""
    if acc is None:
        o, l, m = part
        return o.astype(jnp.float32), l, m
    o1, l1, m1 = acc
    o2, l2, m2 = part
    hi = jnp.maximum(l1, l2)
    safe = jnp.where(jnp.isneginf(hi), 0.0, hi)
    w1, w2 = jnp.exp(l1 - safe), jnp.exp(l2 - safe)
    tot = w1 + w2
    lse = jnp.where(tot > 0, safe + jnp.log(jnp.where(tot > 0, tot, 1.0)), -jnp.inf)
    denom = jnp.where(tot > 0, tot, 1.0)
    a1 = jnp.transpose(w1 / denom, (0, 2, 1))[..., None]
    a2 = jnp.transpose(w2 / denom, (0, 2, 1))[..., None]
    out = a1 * o1 + a2 * o2.astype(jnp.float32)
    mx = None if m1 is None else jnp.maximum(m1, m2)
    return out, lse, mx


# ----------------------------------------------------------------------------
# Forward.


def _pair_forward(impl, config, want_max, pair_ops, qp, kvp):
    if not config.is_causal:
        out, lse, mx = impl.forward(config, pair_ops, True, want_max)
        return out, lse, mx
    full_cfg = dataclasses.replace(config, is_causal=False)
    q, v = pair_ops.query, pair_ops.value
    B, t, N = q.shape[0], q.shape[1], q.shape[2]

    def full():
        return tuple(impl.forward(full_cfg, pair_ops, True, want_max))

    def diag():
        return tuple(impl.forward(config, pair_ops, True, want_max))

    def skip():
        return (jnp.zeros((B, t, N, v.shape[3]), q.dtype), jnp.full((B, N, t), -jnp.inf, jnp.float32),
                jnp.full((B, N), -jnp.inf, jnp.float32) if want_max else None)

    return lax.switch(_branch_index(qp, kvp), [full, diag, skip])


def forward(impl, config: AttentionConfig, cp: ContextParallel, cp_size: int, want_max: bool, ops: Operands):
    """Per-device CP forward: (out [B,Tl,N,Hv], lse [B,N,Tl], max_logit [B,N] pmax'ed over cp or None).

    With a sink, lse includes it (as the kernels' lse does)."""
    out, lse, mx = _forward_blocks(impl, _block_config(config), cp, cp_size, want_max, ops)
    if ops.sink_logits is not None:
        out, lse = _apply_sink(out, lse, ops.sink_logits)
    return out.astype(ops.query.dtype), lse, mx


def _forward_blocks(impl, config: AttentionConfig, cp: ContextParallel, cp_size: int, want_max: bool,
                    ops: Operands):
    """The merged vanilla-softmax (out f32 or input dtype, lse, max_logit) of the blocks."""
    axis = cp.axis
    rank = lax.axis_index(axis)
    Tl, Sl = ops.query.shape[1], ops.key.shape[1]
    qpieces = _pieces(Tl, rank, cp_size, cp, _needs_split(config, cp, config.has_q_seq_lengths))
    split_kv = _needs_split(config, cp, config.has_kv_seq_lengths)
    acc = [None] * len(qpieces)

    def attend(k, v, kvseg, src, src_is_block=True):
        kvps = (_pieces(Sl, src, cp_size, cp, split_kv) if src_is_block
                else [_Piece(0, k.shape[1], None, None)])
        for kvp in kvps:
            if kvp.chunk is None and src_is_block and not cp.load_balanced:
                kvp.offset = src * Sl
            for i, qp in enumerate(qpieces):
                if qp.chunk is None and not cp.load_balanced:
                    qp.offset = rank * Tl
                seed = _block_seed(ops.dropout_seed, _q_tag(qp, rank), _kv_tag(kvp, src))
                part = _pair_forward(impl, config, want_max, _pair_ops(ops, qp, kvp, k, v, kvseg, seed), qp, kvp)
                acc[i] = _merge(acc[i], part)

    k, v, kvseg = ops.key, ops.value, ops.kv_segment_ids
    if _fast_causal(impl, config, cp, ops):
        if cp.strategy == "all_gather":
            return _all_gather_causal_forward(impl, config, cp, cp_size, want_max, ops, rank)
        return _ring_causal_forward(impl, config, cp, cp_size, want_max, ops, rank)
    if cp.strategy == "all_gather":
        gather = lambda x: None if x is None else lax.all_gather(x, axis, axis=1, tiled=True)
        kg, vg, sg = gather(k), gather(v), gather(kvseg)
        if not split_kv:
            attend(kg, vg, sg, None, src_is_block=False)
        else:
            for src in range(cp_size):
                sl = lambda x: None if x is None else lax.slice_in_dim(x, src * Sl, (src + 1) * Sl, axis=1)
                attend(sl(kg), sl(vg), sl(sg), src)
    else:
        perm = [(i, (i + 1) % cp_size) for i in range(cp_size)]
        block = (k, v, kvseg)
        for step in range(cp_size):
            src = (rank - step) % cp_size
            nxt = None
            if step + 1 < cp_size:
                nxt = tuple(None if x is None else lax.ppermute(x, axis, perm) for x in block)
            attend(*block, src)
            block = nxt

    outs, lses, mxs = zip(*acc)
    out = jnp.concatenate(outs, axis=1) if len(outs) > 1 else outs[0]
    lse = jnp.concatenate(lses, axis=2) if len(lses) > 1 else lses[0]
    mx = None
    if want_max:
        mx = mxs[0]
        for m in mxs[1:]:
            mx = jnp.maximum(mx, m)
        mx = pmax_nan(mx, axis)
    return out, lse, mx


# ----------------------------------------------------------------------------
# Backward.


def _pair_backward(impl, config, pair_ops, out, lse, dout, dlse, qp, kvp):
    def call(cfg):
        dq, dk, dv, _ = impl.backward(cfg, pair_ops, out, lse, dout, dlse)
        return dq.astype(jnp.float32), dk.astype(jnp.float32), dv.astype(jnp.float32)

    if not config.is_causal:
        return call(config)
    full_cfg = dataclasses.replace(config, is_causal=False)
    q, k, v = pair_ops.query, pair_ops.key, pair_ops.value

    def skip():
        return (jnp.zeros(q.shape, jnp.float32), jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))

    return lax.switch(_branch_index(qp, kvp), [lambda: call(full_cfg), lambda: call(config), skip])


def backward(impl, config: AttentionConfig, cp: ContextParallel, cp_size: int, ops: Operands,
             out, lse, dout, dlse):
    """Per-device CP backward: (dq, dk, dv) like the local q, k, v; with a sink also
    dsink f32 [B, N] (per local batch row, summed over the cp axis).

    out and lse are the final (sink-including) forward results of the local rows."""
    grads = _backward_blocks(impl, _block_config(config), cp, cp_size, ops, out, lse, dout, dlse)
    if ops.sink_logits is None:
        return grads
    dsink = lax.psum(_sink_grad(ops.sink_logits, out, lse, dout, dlse), cp.axis)
    return grads + (dsink,)


def _backward_blocks(impl, config: AttentionConfig, cp: ContextParallel, cp_size: int, ops: Operands,
                     out, lse, dout, dlse):
    axis = cp.axis
    rank = lax.axis_index(axis)
    Tl, Sl = ops.query.shape[1], ops.key.shape[1]
    qpieces = _pieces(Tl, rank, cp_size, cp, _needs_split(config, cp, config.has_q_seq_lengths))
    for qp in qpieces:
        if qp.chunk is None and not cp.load_balanced:
            qp.offset = rank * Tl
    split_kv = _needs_split(config, cp, config.has_kv_seq_lengths)
    dq_acc = [None] * len(qpieces)

    def add(a, b):
        return b if a is None else a + b

    def block_grads(k, v, kvseg, src, src_is_block=True):
        """dq contributions (accumulated) and (dk, dv) f32 for this kv block."""
        kvps = (_pieces(k.shape[1], src, cp_size, cp, split_kv) if src_is_block
                else [_Piece(0, k.shape[1], None, None)])
        dks, dvs = [], []
        for kvp in kvps:
            if kvp.chunk is None and src_is_block and not cp.load_balanced:
                kvp.offset = src * Sl
            dk = dv = None
            for i, qp in enumerate(qpieces):
                seed = _block_seed(ops.dropout_seed, _q_tag(qp, rank), _kv_tag(kvp, src))
                pair = _pair_ops(ops, qp, kvp, k, v, kvseg, seed)
                g = _pair_backward(
                    impl, config, pair, _seq_slice(out, qp, 1), _seq_slice(lse, qp, 2),
                    _seq_slice(dout, qp, 1), _seq_slice(dlse, qp, 2), qp, kvp)
                dq_acc[i] = add(dq_acc[i], g[0])
                dk, dv = add(dk, g[1]), add(dv, g[2])
            dks.append(dk)
            dvs.append(dv)
        cat = lambda xs: jnp.concatenate(xs, axis=1) if len(xs) > 1 else xs[0]
        return cat(dks), cat(dvs)

    k, v, kvseg = ops.key, ops.value, ops.kv_segment_ids
    if _fast_causal(impl, config, cp, ops):
        if cp.strategy == "all_gather":
            return _all_gather_causal_backward(impl, config, cp, cp_size, ops, out, lse, dout, dlse, rank)
        return _ring_causal_backward(impl, config, cp, cp_size, ops, out, lse, dout, dlse, rank)
    if cp.strategy == "all_gather":
        gather = lambda x: None if x is None else lax.all_gather(x, axis, axis=1, tiled=True)
        kg, vg, sg = gather(k), gather(v), gather(kvseg)
        if not split_kv:
            dk_full, dv_full = block_grads(kg, vg, sg, None, src_is_block=False)
        else:
            dks, dvs = [], []
            for src in range(cp_size):
                sl = lambda x: None if x is None else lax.slice_in_dim(x, src * Sl, (src + 1) * Sl, axis=1)
                dk_b, dv_b = block_grads(sl(kg), sl(vg), sl(sg), src)
                dks.append(dk_b)
                dvs.append(dv_b)
            dk_full, dv_full = jnp.concatenate(dks, axis=1), jnp.concatenate(dvs, axis=1)
        dk = lax.psum_scatter(dk_full, axis, scatter_dimension=1, tiled=True)
        dv = lax.psum_scatter(dv_full, axis, scatter_dimension=1, tiled=True)
    else:
        perm = [(i, (i + 1) % cp_size) for i in range(cp_size)]
        rot = lambda xs: tuple(None if x is None else lax.ppermute(x, axis, perm) for x in xs)
        block = (k, v, kvseg)
        dk = dv = None
        for step in range(cp_size):
            src = (rank - step) % cp_size
            nxt = rot(block) if step + 1 < cp_size else None
            dk_b, dv_b = block_grads(*block, src)
            if dk is None:
                dk, dv = dk_b, dv_b
            else:
                dk, dv = dk + dk_b, dv + dv_b
            # The accumulators travel with their kv block; after the last step one
            # more hop brings each back to its owner.
            dk, dv = rot((dk, dv))
            block = nxt
    dq = jnp.concatenate(dq_acc, axis=1) if len(dq_acc) > 1 else dq_acc[0]
    return dq.astype(ops.query.dtype), dk.astype(ops.key.dtype), dv.astype(ops.value.dtype)


# ----------------------------------------------------------------------------
# Causal without padding lengths: fewer, larger kernel calls.
#
# all_gather: a query chunk at global offset o (size c) against the whole
# gathered key sequence in natural order is exactly "bottom-right causal with
# kv length o + c" (diagonal offset (o + c) - c = o; keys past o + c are not
# visible to any of its queries anyway): one call per query chunk.
#
# ring: step 0 holds the rank's own block: plain top-left causal on the local
# block (also right for the dual-chunk layout: local chunk r vs 2cp-1-r is all
# masked, 2cp-1-r vs r all visible). Later steps hold the block of src != rank:
#   plain layout:  src < rank: fully visible; src > rank: skipped;
#   dual-chunk:    src < rank: all local queries see the first kv chunk only;
#                  src > rank: only the second query chunk sees, the whole block.


def _fast_causal(impl, config: AttentionConfig, cp: ContextParallel, ops: Operands) -> bool:
    if not config.is_causal or config.has_q_seq_lengths or config.has_kv_seq_lengths:
        return False
    if cp.strategy == "all_gather":
        # Its calls are bottom-right causal with kv lengths, which a backend may refuse
        # (cuDNN: not together with dropout or segment ids): then the chunk-pair path.
        return impl.unsupported_reason(_ag_config(config), ops) is None
    return True


def _ag_config(config: AttentionConfig) -> AttentionConfig:
    return dataclasses.replace(config, bottom_right=True, has_kv_seq_lengths=True)


def _to_natural(x, cp_size, inverse=False):
    """Gathered dual-chunk layout <-> natural order along axis 1."""
    from maxattn._src import load_balance
    if x is None:
        return None
    if inverse:
        return load_balance.reorder_for_load_balancing(x, cp_size, 1)
    return load_balance.inverse_reorder_for_load_balancing(x, cp_size, 1)


def _ag_chunk_calls(config, cp, cp_size, ops, rank, kn, vn, sn):
    """(config, pair Operands, q piece) for each local query chunk vs the natural-order K/V."""
    Tl = ops.query.shape[1]
    cfg = _ag_config(config)
    B = ops.query.shape[0]
    calls = []
    for qp in _pieces(Tl, rank, cp_size, cp, split=True):
        kvlen = jnp.broadcast_to(jnp.asarray(qp.offset + qp.size, jnp.int32), (B,))
        pair = Operands(_seq_slice(ops.query, qp, 1), kn, vn, None, None, None, kvlen,
                        _seq_slice(ops.q_segment_ids, qp, 1), sn, None,
                        _block_seed(ops.dropout_seed, qp.chunk, _GATHERED))
        calls.append((cfg, pair, qp))
    return calls


def _gather_natural(cp, cp_size, x):
    if x is None:
        return None
    g = lax.all_gather(x, cp.axis, axis=1, tiled=True)
    return _to_natural(g, cp_size) if cp.load_balanced else g


def _all_gather_causal_forward(impl, config, cp, cp_size, want_max, ops, rank):
    kn, vn, sn = (_gather_natural(cp, cp_size, x) for x in (ops.key, ops.value, ops.kv_segment_ids))
    outs, lses, mx = [], [], None
    for cfg, pair, _ in _ag_chunk_calls(config, cp, cp_size, ops, rank, kn, vn, sn):
        o, l, m = impl.forward(cfg, pair, True, want_max)
        outs.append(o)
        lses.append(l)
        mx = m if mx is None else jnp.maximum(mx, m)
    out = jnp.concatenate(outs, axis=1) if len(outs) > 1 else outs[0]
    lse = jnp.concatenate(lses, axis=2) if len(lses) > 1 else lses[0]
    return out, lse, (pmax_nan(mx, cp.axis) if want_max else None)


def _all_gather_causal_backward(impl, config, cp, cp_size, ops, out, lse, dout, dlse, rank):
    kn, vn, sn = (_gather_natural(cp, cp_size, x) for x in (ops.key, ops.value, ops.kv_segment_ids))
    dqs, dk, dv = [], None, None
    for cfg, pair, qp in _ag_chunk_calls(config, cp, cp_size, ops, rank, kn, vn, sn):
        dq_p, dk_p, dv_p, _ = impl.backward(cfg, pair, _seq_slice(out, qp, 1), _seq_slice(lse, qp, 2),
                                            _seq_slice(dout, qp, 1), _seq_slice(dlse, qp, 2))
        dqs.append(dq_p)
        dk = dk_p.astype(jnp.float32) if dk is None else dk + dk_p.astype(jnp.float32)
        dv = dv_p.astype(jnp.float32) if dv is None else dv + dv_p.astype(jnp.float32)
    if cp.load_balanced:
        dk, dv = _to_natural(dk, cp_size, inverse=True), _to_natural(dv, cp_size, inverse=True)
    dk = lax.psum_scatter(dk, cp.axis, scatter_dimension=1, tiled=True)
    dv = lax.psum_scatter(dv, cp.axis, scatter_dimension=1, tiled=True)
    dq = jnp.concatenate(dqs, axis=1) if len(dqs) > 1 else dqs[0]
    return dq.astype(ops.query.dtype), dk.astype(ops.key.dtype), dv.astype(ops.value.dtype)


def _half(x, which, axis=1):
    if x is None:
        return None
    n = x.shape[axis] // 2
    return lax.slice_in_dim(x, which * n, (which + 1) * n, axis=axis)


def _pad_first_half(x, axis, fill):
    """[.., n, ..] -> [.., 2n, ..] with the first half filled with `fill`."""
    pad = jnp.full_like(x, fill)
    return jnp.concatenate([pad, x], axis=axis)


def _pad_second_half(x, axis, fill):
    return jnp.concatenate([x, jnp.full_like(x, fill)], axis=axis)


def _ring_causal_forward(impl, config, cp, cp_size, want_max, ops, rank):
    full_cfg = dataclasses.replace(config, is_causal=False)
    perm = [(i, (i + 1) % cp_size) for i in range(cp_size)]
    q, qseg = ops.query, ops.q_segment_ids
    B, Tl, N = q.shape[0], q.shape[1], q.shape[2]
    Hv = ops.value.shape[3]
    block = (ops.key, ops.value, ops.kv_segment_ids)

    seed = ops.dropout_seed

    def call(cfg, qq, qs, k, v, ks, q_tag, kv_tag):
        ops_b = Operands(qq, k, v, None, None, None, None, qs, ks, None, _block_seed(seed, q_tag, kv_tag))
        return tuple(impl.forward(cfg, ops_b, True, want_max))

    def skip(t):
        return (jnp.zeros((B, t, N, Hv), q.dtype), jnp.full((B, N, t), -jnp.inf, jnp.float32),
                jnp.full((B, N), -jnp.inf, jnp.float32) if want_max else None)

    acc = None
    for step in range(cp_size):
        nxt = (tuple(None if x is None else lax.ppermute(x, cp.axis, perm) for x in block)
               if step + 1 < cp_size else None)
        k, v, ks = block
        if step == 0:
            part = call(config, q, qseg, k, v, ks, _WHOLE + rank, _WHOLE + rank)
        else:
            src = (rank - step) % cp_size
            if not cp.load_balanced:
                part = lax.cond(src < rank, lambda: call(full_cfg, q, qseg, k, v, ks, _WHOLE + rank, _WHOLE + src),
                                lambda: skip(Tl))
            else:
                def earlier():  # all queries vs the first kv chunk
                    return call(full_cfg, q, qseg, _half(k, 0), _half(v, 0), _half(ks, 0), _WHOLE + rank, src)

                def later():  # the second query chunk vs the whole block
                    o, l, m = call(full_cfg, _half(q, 1), _half(qseg, 1), k, v, ks,
                                   2 * cp_size - 1 - rank, _WHOLE + src)
                    return (_pad_first_half(o, 1, 0), _pad_first_half(l, 2, -jnp.inf), m)

                part = lax.cond(src < rank, earlier, later)
        acc = _merge(acc, part)
        block = nxt
    out, lse, mx = acc
    return out, lse, (pmax_nan(mx, cp.axis) if want_max else None)


def _ring_causal_backward(impl, config, cp, cp_size, ops, out, lse, dout, dlse, rank):
    full_cfg = dataclasses.replace(config, is_causal=False)
    perm = [(i, (i + 1) % cp_size) for i in range(cp_size)]
    rot = lambda xs: tuple(None if x is None else lax.ppermute(x, cp.axis, perm) for x in xs)
    q, qseg = ops.query, ops.q_segment_ids
    f32 = lambda x: x.astype(jnp.float32)

    seed = ops.dropout_seed

    def call(cfg, qq, qs, o, l, do, dl, k, v, ks, q_tag, kv_tag):
        ops_b = Operands(qq, k, v, None, None, None, None, qs, ks, None, _block_seed(seed, q_tag, kv_tag))
        dq, dk, dv, _ = impl.backward(cfg, ops_b, o, l, do, dl)
        return f32(dq), f32(dk), f32(dv)

    block = (ops.key, ops.value, ops.kv_segment_ids)
    dq = dk = dv = None
    for step in range(cp_size):
        nxt = rot(block) if step + 1 < cp_size else None
        k, v, ks = block
        if step == 0:
            g = call(config, q, qseg, out, lse, dout, dlse, k, v, ks, _WHOLE + rank, _WHOLE + rank)
        else:
            src = (rank - step) % cp_size
            zeros = lambda: (jnp.zeros(q.shape, jnp.float32), jnp.zeros(k.shape, jnp.float32),
                             jnp.zeros(v.shape, jnp.float32))
            if not cp.load_balanced:
                g = lax.cond(src < rank, lambda: call(full_cfg, q, qseg, out, lse, dout, dlse, k, v, ks,
                                                      _WHOLE + rank, _WHOLE + src), zeros)
            else:
                def earlier():
                    dq_, dk_, dv_ = call(full_cfg, q, qseg, out, lse, dout, dlse, _half(k, 0), _half(v, 0),
                                         _half(ks, 0), _WHOLE + rank, src)
                    return dq_, _pad_second_half(dk_, 1, 0), _pad_second_half(dv_, 1, 0)

                def later():
                    dq_, dk_, dv_ = call(full_cfg, _half(q, 1), _half(qseg, 1), _half(out, 1), _half(lse, 1, 2),
                                         _half(dout, 1), _half(dlse, 1, 2), k, v, ks,
                                         2 * cp_size - 1 - rank, _WHOLE + src)
                    return _pad_first_half(dq_, 1, 0), dk_, dv_

                g = lax.cond(src < rank, earlier, later)
        dq = g[0] if dq is None else dq + g[0]
        dk = g[1] if dk is None else dk + g[1]
        dv = g[2] if dv is None else dv + g[2]
        dk, dv = rot((dk, dv))
        block = nxt
    return dq.astype(q.dtype), dk.astype(ops.key.dtype), dv.astype(ops.value.dtype)

"""Partitioning rules for the fused attention primitives (any backend).

`partitioned(impl, cp)` wraps a backend module (cpu, cudnn, or the pure-JAX
`ReferenceBackend` used for CP with implementation="xla") into an object with
the same `forward` / `backward` contract, whose calls are
`jax.experimental.custom_partitioning` functions with a Shardy sharding rule
(and GSPMD callbacks). Under `jit` with sharded inputs each device runs the
backend on its own block:

* batch sharded on any mesh axes (DP / FSDP): per-device blocks, no gather;
* query heads and kv heads sharded on the same axes (TP); with MQA (K=1) or
  when K is not divisible by the head sharding, kv heads are replicated
  (K=1) or head sharding is dropped with a warning;
* sequence sharded: only with `context_parallel` (see context_parallel.py);
  otherwise the sequence is replicated (XLA all-gathers it) with a warning;
* head_dim sharded: replicated with a warning.

max_logit comes out per (batch, head) [B, N], sharded like (batch, heads);
the public API's `jnp.max(axis=0)` then makes XLA all-reduce (max) over the
batch axes, so the result is the global max, sharded like the heads. Under CP
the per-device kernel pmax-es over the cp axis itself. lse is sharded like q.
A bias broadcast over batch (or heads) gets its gradient psum-ed over the
batch (or head) axes.

Vmap is handled by folding the mapped axes into the batch (batching.py)
outside the custom_partitioning call.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import warnings
from typing import Callable, Optional

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec as P

from maxattn._src import batching, context_parallel, reference
from maxattn._src.config import AttentionConfig, Operands

_FIELDS = Operands._fields
_ROLES = (batching.BATCH,) * 3 + (batching.BCAST,) * 2 + (batching.BATCH,) * 4 + (batching.REPL,) * 2

_warned: set[str] = set()


def _warn_once(message: str) -> None:
    if message not in _warned:
        _warned.add(message)
        warnings.warn(message, RuntimeWarning, stacklevel=2)


# ----------------------------------------------------------------------------
# The pure-JAX path seen through the backend contract (used for CP with
# implementation="xla", and in the tests to exercise the partitioning code).


class ReferenceBackend:
    """`forward` / `backward` of the backend contract, in pure JAX.

    `backward` is the flash-attention backward from the given (global) lse and
    output, so it can run on a block of keys, like the fused backends.
    """

    name = "xla"

    @staticmethod
    def unsupported_reason(config, ops):
        return None

    @staticmethod
    def forward(config: AttentionConfig, ops: Operands, want_lse: bool, want_max: bool):
        out, lse, mx = reference.attention(config, ops)
        f32 = jnp.promote_types(lse.dtype, jnp.float32)
        return out, (lse.astype(f32) if want_lse else None), (mx.astype(f32) if want_max else None)

    @staticmethod
    def backward(config: AttentionConfig, ops: Operands, out, lse, dout, dlse):
        q, k, v = ops.query, ops.key, ops.value
        N, K = q.shape[2], k.shape[2]
        G = N // K
        ct = jnp.promote_types(q.dtype, jnp.float32)
        s = reference.raw_logits(config, ops)
        vis = jnp.broadcast_to(reference.visibility(config, ops), s.shape)
        if config.softcap:
            th = jnp.tanh(s / config.softcap)
            logits = config.softcap * th
        else:
            logits = s
        lse_b = lse.astype(ct)[..., None]
        live = vis & ~jnp.isneginf(lse_b)
        p = jnp.where(live, jnp.exp(jnp.where(live, logits - lse_b, 0.0)), 0.0)
        hp = jax.lax.Precision.HIGHEST
        rep = lambda x: jnp.repeat(x, G, axis=2) if G > 1 else x
        do = dout.astype(ct)
        dp = jnp.einsum("btnd,bsnd->bnts", do, rep(v).astype(ct), precision=hp)
        pz = p
        if config.dropout_rate > 0:
            z = jnp.where(reference.dropout_keep(config, ops),
                          jnp.asarray(reference.dropout_scale(config.dropout_rate), ct), 0)
            pz = p * z
            dp = dp * z
        D = jnp.transpose(jnp.sum(do * out.astype(ct), axis=-1), (0, 2, 1))[..., None]
        dd = D if dlse is None else D - dlse.astype(ct)[..., None]
        dsink = None
        if ops.sink_logits is not None:  # per batch row [B, N]
            sink = ops.sink_logits.astype(ct)[None, :, None, None]
            dsink = -jnp.sum(jnp.exp(sink - lse_b) * dd, axis=(2, 3)).astype(jnp.float32)
        ds = p * (dp - dd)
        if config.softcap:
            ds = ds * (1.0 - th * th)
        dq = jnp.einsum("bnts,bsnh->btnh", ds, rep(k).astype(ct), precision=hp) * config.scale
        dk = jnp.einsum("bnts,btnh->bsnh", ds, q.astype(ct), precision=hp) * config.scale
        dv = jnp.einsum("bnts,btnd->bsnd", pz, do, precision=hp)
        B, S = k.shape[0], k.shape[1]
        dk = dk.reshape(B, S, K, G, -1).sum(3)
        dv = dv.reshape(B, S, K, G, -1).sum(3)
        dbias = None
        if config.has_bias:
            axes = tuple(i for i in range(4) if ops.bias.shape[i] == 1 and ds.shape[i] != 1)
            dbias = jnp.sum(ds, axis=axes, keepdims=True).reshape(ops.bias.shape).astype(jnp.float32)
        res = (dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), dbias)
        return res + ((dsink,) if dsink is not None else ())  # 5-tuple only with sinks


# ----------------------------------------------------------------------------
# Helpers.


@contextlib.contextmanager
def _no_abstract_mesh():
    """The per-device kernel must be traced without the user's (explicit) mesh context."""
    try:
        ctx = jax.sharding.use_abstract_mesh(jax.sharding.AbstractMesh((), ()))
    except Exception:  # pragma: no cover - older/newer jax without these APIs
        ctx = contextlib.nullcontext()
    with ctx:
        yield


def _axes(entry) -> tuple:
    if entry is None:
        return ()
    if isinstance(entry, (tuple, list)):
        return tuple(a for a in entry if a is not None)
    return (entry,)


def _spec_entry(axes: tuple):
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else tuple(axes)


def _padded_spec(sharding, ndim) -> tuple:
    if not isinstance(sharding, NamedSharding):
        return (None,) * ndim
    spec = tuple(sharding.spec)
    return spec + (None,) * (ndim - len(spec))


@dataclasses.dataclass(frozen=True)
class _Plan:
    """How the call is laid out on the mesh."""

    batch: tuple
    heads: tuple
    kv_heads: tuple
    seq: tuple       # () or (cp_axis,)
    cp_size: int

    def q(self):
        return P(_spec_entry(self.batch), _spec_entry(self.seq), _spec_entry(self.heads), None)

    def kv(self):
        return P(_spec_entry(self.batch), _spec_entry(self.seq), _spec_entry(self.kv_heads), None)

    def lse(self):
        return P(_spec_entry(self.batch), _spec_entry(self.heads), _spec_entry(self.seq))

    def mx(self):
        return P(_spec_entry(self.batch), _spec_entry(self.heads))

    def broadcastable(self, shape):  # bias / mask [b', n', t', s']
        return P(*(None if d == 1 else _spec_entry(a)
                   for d, a in zip(shape, (self.batch, self.heads, self.seq, self.seq))))

    def operand_specs(self, names, shapes):
        specs = []
        for name, shape in zip(names, shapes):
            if name == "query":
                specs.append(self.q())
            elif name in ("key", "value"):
                specs.append(self.kv())
            elif name in ("bias", "mask"):
                specs.append(self.broadcastable(shape))
            elif name in ("q_seq_lengths", "kv_seq_lengths"):
                specs.append(P(_spec_entry(self.batch)))
            elif name in ("q_segment_ids", "kv_segment_ids"):
                specs.append(P(_spec_entry(self.batch), _spec_entry(self.seq)))
            elif name in ("out", "dout"):
                specs.append(self.q())
            elif name in ("lse", "dlse"):
                specs.append(self.lse())
            elif name == "sink_logits":
                specs.append(P(_spec_entry(self.heads)))
            elif name == "dropout_seed":
                specs.append(P(None))
            else:  # pragma: no cover
                raise AssertionError(name)
        return specs


def _make_plan(mesh, names, arg_shapes, cp: Optional[context_parallel.ContextParallel], what: str) -> _Plan:
    if not names or names[0] != "query":  # pragma: no cover
        raise AssertionError(names)
    q = arg_shapes[0]
    k = arg_shapes[names.index("key")]
    K = k.shape[2]
    if not isinstance(q.sharding, NamedSharding):
        _warn_once(f"maxattn: {what}: the mesh axis names of the input sharding are unknown "
                   f"({type(q.sharding).__name__}); running it replicated. Use NamedSharding inputs "
                   "or call under `with mesh:`.")
        return _Plan((), (), (), (), 1)
    spec = _padded_spec(q.sharding, 4)
    batch, seq, heads, hdim = (_axes(e) for e in spec)
    size = lambda axes: math.prod(mesh.shape[a] for a in axes)
    cp_size = 1
    if cp is not None:
        if cp.axis not in mesh.axis_names:
            raise ValueError(f"context_parallel_axis={cp.axis!r} is not an axis of the mesh "
                             f"{tuple(mesh.axis_names)}")
        if cp.axis in batch or cp.axis in heads:
            _warn_once(f"maxattn: {what}: mesh axis {cp.axis!r} is the context-parallel axis but also shards "
                       "the batch or heads of `query`; resharding so that it shards the sequence only")
            batch = tuple(a for a in batch if a != cp.axis)
            heads = tuple(a for a in heads if a != cp.axis)
        if set(seq) - {cp.axis}:
            _warn_once(f"maxattn: {what}: the sequence of `query` is sharded over {seq}; with "
                       f"context_parallel only {cp.axis!r} may shard it; resharding")
        cp_size = mesh.shape[cp.axis]
        seq = (cp.axis,) if cp_size > 1 else ()
        context_parallel.check_sizes(cp, cp_size, q.shape[1], k.shape[1])
    elif seq:
        _warn_once(f"maxattn: {what}: the sequence axis of `query` is sharded over mesh axes {seq} but "
                   "context_parallel is not set, so it is gathered (replicated) for attention; pass "
                   "context_parallel='all_gather' or 'ring' with context_parallel_axis to shard attention "
                   "over the sequence")
        seq = ()
    if hdim:
        _warn_once(f"maxattn: {what}: the head_dim axis of `query` is sharded over {hdim}; it is gathered")
    tp = size(heads)
    if tp == 1:
        kv_heads = ()
    elif K % tp == 0:
        kv_heads = heads
    elif K == 1:
        kv_heads = ()
    else:
        _warn_once(f"maxattn: {what}: query heads are sharded {tp}-way over {heads} but the {K} kv heads are "
                   f"not divisible by {tp}; replicating the heads (shard heads over a divisor of K={K})")
        heads = kv_heads = ()
    return _Plan(batch, heads, kv_heads, seq, cp_size)


def _seed_with_offsets(ops: Operands, plan: _Plan) -> Operands:
    """Adds this shard's global (batch, head) offset to words 2, 3 of the dropout seed,
    so that every shard draws its part of the unsharded call's mask."""
    if ops.dropout_seed is None or not (plan.batch or plan.heads):
        return ops
    seed = ops.dropout_seed
    if plan.batch:
        seed = seed.at[2].add(jax.lax.axis_index(plan.batch).astype(jnp.uint32)
                              * jnp.uint32(ops.query.shape[0]))
    if plan.heads:
        seed = seed.at[3].add(jax.lax.axis_index(plan.heads).astype(jnp.uint32)
                              * jnp.uint32(ops.query.shape[2]))
    return ops._replace(dropout_seed=seed)


def _sharding_rule(names, shapes, G, backward_bias_shape=None, forward=True, want_max=True,
                   want_dsink=False):
    """Einsum-like Shardy rule: b batch, t/s sequence, k kv heads, g group, h/d head dims.

    Query heads are the compound factor (k g) so that TP shards q and kv heads
    together; with a single kv head (MQA) the query heads are their own factor n.
    """
    K = shapes[names.index("key")][2]
    H = "k" if G == 1 else ("n" if K == 1 else "(k g)")
    uniq = iter(f"u{i}" for i in range(64))

    def bcast(shape):
        return " ".join(next(uniq) if dim == 1 else f for dim, f in zip(shape, ("b", H, "t", "s")))

    ops = []
    for name, shape in zip(names, shapes):
        ops.append({
            "query": f"b t {H} h", "key": "b s k h", "value": "b s k d",
            "q_seq_lengths": "b", "kv_seq_lengths": "b",
            "q_segment_ids": "b t", "kv_segment_ids": "b s",
            "out": f"b t {H} d", "dout": f"b t {H} d", "lse": f"b {H} t", "dlse": f"b {H} t",
            "sink_logits": H,
        }.get(name) or (next(uniq) if name == "dropout_seed" else bcast(shape)))
    if forward:
        res = [f"b t {H} d", f"b {H} t"] + ([f"b {H}"] if want_max else [])
    else:
        res = [f"b t {H} h", "b s k h", "b s k d"]
        if backward_bias_shape is not None:
            res.append(bcast(backward_bias_shape))
        if want_dsink:
            res.append(f"b {H}")
    sizes = {"g": G} if H == "(k g)" else {}
    return ", ".join(ops) + " -> " + ", ".join(res), sizes


def _named(mesh, specs):
    return tuple(NamedSharding(mesh, s) for s in specs)


# ----------------------------------------------------------------------------
# The partitioned forward / backward.


def _custom_partitioned(global_fn: Callable, per_device: Callable, result_specs: Callable[[_Plan], list],
                        names: tuple, cp: Optional[context_parallel.ContextParallel], what: str, rule: str,
                        sizes: dict) -> Callable:
    """`global_fn` as a custom_partitioning function over the operands `names`.

    `result_specs(plan)` gives the result PartitionSpecs; each device runs
    `per_device(plan, *arrays)` on its blocks (traced without the user's mesh).
    """
    fn = custom_partitioning(global_fn)

    def infer(mesh, arg_shapes, result_shape):
        plan = _make_plan(mesh, names, arg_shapes, cp, what)
        return _named(mesh, result_specs(plan))

    def partition(mesh, arg_shapes, result_shape):
        plan = _make_plan(mesh, names, arg_shapes, cp, what)
        arg_shardings = _named(mesh, plan.operand_specs(names, [a.shape for a in arg_shapes]))

        def lower(*arrays):
            with _no_abstract_mesh():
                return per_device(plan, *arrays)

        return mesh, lower, _named(mesh, result_specs(plan)), arg_shardings

    fn.def_partition(partition, infer_sharding_from_operands=infer, sharding_rule=rule, **sizes)
    return fn


@functools.cache
def _forward_cp(impl, config: AttentionConfig, want_max: bool, cp, names: tuple, shapes: tuple, G: int):
    def unpack(arrays):
        return Operands(**dict(zip(names, arrays)))

    def global_fn(*arrays):
        out, lse, mx = impl.forward(config, unpack(arrays), True, want_max)
        return (out, lse, mx) if want_max else (out, lse)

    def result_specs(plan):
        return [plan.q(), plan.lse()] + ([plan.mx()] if want_max else [])

    def per_device(plan, *arrays):
        ops = _seed_with_offsets(unpack(arrays), plan)
        if cp is not None and plan.cp_size > 1:
            out, lse, mx = context_parallel.forward(impl, config, cp, plan.cp_size, want_max, ops)
        else:
            out, lse, mx = impl.forward(config, ops, True, want_max)
        return (out, lse, mx) if want_max else (out, lse)

    rule, sizes = _sharding_rule(names, shapes, G, forward=True, want_max=want_max)
    return _custom_partitioned(global_fn, per_device, result_specs, names, cp, "attention forward", rule,
                               sizes)


@functools.cache
def _backward_cp(impl, config: AttentionConfig, cp, names: tuple, shapes: tuple, G: int):
    op_names = tuple(n for n in names if n in _FIELDS)
    bias_shape = shapes[names.index("bias")] if "bias" in names else None
    has_sink = "sink_logits" in names

    def unpack(arrays):
        d = dict(zip(names, arrays))
        ops = Operands(**{n: d[n] for n in op_names})
        return ops, d["out"], d["lse"], d["dout"], d.get("dlse")

    def global_fn(*arrays):
        ops, out, lse, dout, dlse = unpack(arrays)
        dq, dk, dv, db, *ds = impl.backward(config, ops, out, lse, dout, dlse)
        return (dq, dk, dv) + ((db,) if bias_shape is not None else ()) + ((ds[0],) if has_sink else ())

    def result_specs(plan):
        specs = [plan.q(), plan.kv(), plan.kv()]
        if bias_shape is not None:
            specs.append(plan.broadcastable(bias_shape))
        if has_sink:
            specs.append(plan.mx())
        return specs

    def per_device(plan, *arrays):
        ops, out, lse, dout, dlse = unpack(arrays)
        ops = _seed_with_offsets(ops, plan)
        ds = None
        if cp is not None and plan.cp_size > 1:
            dq, dk, dv, *rest = context_parallel.backward(impl, config, cp, plan.cp_size, ops, out, lse, dout,
                                                          dlse)
            ds = rest[0] if rest else None  # per batch row, already summed over the cp axis
            db = None
        else:
            dq, dk, dv, db, *rest = impl.backward(config, ops, out, lse, dout, dlse)
            ds = rest[0] if rest else None
        tail = (ds,) if has_sink else ()
        if plan.heads and not plan.kv_heads:
            # MQA with sharded query heads: each device holds part of the kv-head gradient.
            dk = jax.lax.psum(dk.astype(jnp.float32), plan.heads).astype(dk.dtype)
            dv = jax.lax.psum(dv.astype(jnp.float32), plan.heads).astype(dv.dtype)
        if bias_shape is None:
            return (dq, dk, dv) + tail
        reduce_axes = ()
        if bias_shape[0] == 1:
            reduce_axes += plan.batch
        if bias_shape[1] == 1:
            reduce_axes += plan.heads
        if reduce_axes:
            db = jax.lax.psum(db, reduce_axes)
        return (dq, dk, dv, db) + tail

    rule, sizes = _sharding_rule(names, shapes, G, backward_bias_shape=bias_shape, forward=False,
                                 want_dsink=has_sink)
    return _custom_partitioned(global_fn, per_device, result_specs, names, cp, "attention backward", rule,
                               sizes)


def _group(arrays):
    q, k = arrays[0], arrays[1]
    return q.shape[2] // k.shape[2] if k.shape[2] else 1


def _present(all_names: tuple, arrays) -> tuple[tuple, list, tuple]:
    """The names, arrays and shapes of the operands that are not None."""
    names = tuple(n for n, a in zip(all_names, arrays) if a is not None)
    present = [a for a in arrays if a is not None]
    return names, present, tuple(tuple(a.shape) for a in present)


class Partitioned:
    """A backend whose forward / backward are custom-partitioned (same contract)."""

    def __init__(self, impl, cp: Optional[context_parallel.ContextParallel]):
        self.impl = impl
        self.cp = cp

    def unsupported_reason(self, config, ops):
        return self.impl.unsupported_reason(config, ops)

    @functools.cache
    def _forward_fn(self, config: AttentionConfig, want_max: bool):
        def fn(*arrays):
            names, present, shapes = _present(_FIELDS, arrays)
            res = _forward_cp(self.impl, config, want_max, self.cp, names, shapes, _group(arrays))(*present)
            return (res[0], res[1], res[2] if want_max else None)
        return batching.fold_into_batch(fn, _ROLES, (None, None, None))

    @functools.cache
    def _backward_fn(self, config: AttentionConfig):
        all_names = _FIELDS + ("out", "lse", "dout", "dlse")

        def fn(*arrays):
            names, present, shapes = _present(all_names, arrays)
            res = _backward_cp(self.impl, config, self.cp, names, shapes, _group(arrays))(*present)
            has_sink = "sink_logits" in names
            return (res[0], res[1], res[2], res[3] if config.has_bias else None,
                    res[-1] if has_sink else None)
        return batching.fold_into_batch(fn, _ROLES + (batching.BATCH,) * 4, (None, None, None, 3, None))

    def forward(self, config: AttentionConfig, ops: Operands, want_lse: bool, want_max: bool):
        out, lse, mx = self._forward_fn(config, bool(want_max))(*ops)
        return out, (lse if want_lse else None), mx

    def backward(self, config: AttentionConfig, ops: Operands, out, lse, dout, dlse):
        """(dq, dk, dv, dbias or None), plus dsink [B, N] when ops has sink_logits."""
        res = tuple(self._backward_fn(config)(*ops, out, lse, dout, dlse))
        return res if ops.sink_logits is not None else res[:4]


@functools.cache
def partitioned(impl, cp: Optional[context_parallel.ContextParallel] = None) -> Partitioned:
    """The backend `impl` (a module or object with forward/backward) with partitioning rules."""
    return Partitioned(impl, cp)

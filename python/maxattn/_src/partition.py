"""Partitioning rules for any backend: `Partitioned(backend, cp)` has the backend's
forward / backward, as `jax.experimental.custom_partitioning` functions with a
Shardy sharding rule (and GSPMD callbacks). Under `jit` with sharded inputs
each device runs the backend on its own block:

* batch sharded on any mesh axes (DP / FSDP): per-device blocks, no gather;
* query heads and kv heads sharded on the same axes (TP); with MQA (K=1) or
  when K is not divisible by the head sharding, kv heads are replicated
  (K=1) or head sharding is dropped with a warning;
* sequence sharded: only with context parallelism (the cp package);
  otherwise the sequence is replicated (XLA all-gathers it) with a warning;
* head_dim sharded: replicated with a warning.

max_logit comes out per (batch, head) [B, N], sharded like (batch, heads);
the public API's max over axis 0 then makes XLA all-reduce (max) over the
batch axes, so the result is the global max, sharded like the heads. With
`options.max_logit_over_batch` it comes out [1, N] instead: each device
reduces its rows (unless the backend's kernel did) and pmax-es over the batch
axes, sharded like the heads. Under CP the per-device call pmax-es over the cp
axis itself. lse is sharded like q.
A bias broadcast over batch (or heads) gets its gradient psum-ed over the
batch (or head) axes.

Both the Shardy rule and the PartitionSpecs are derived from the logical
factors of each array in `call.FIELDS` (b batch, t/s sequence, n query heads,
k kv heads, h/d head dims), so an operand's layout is written once.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
from typing import Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec as P

from maxattn._src import cp as cp_lib
from maxattn._src.call import FIELDS, Call, Fwd, Grads, Operands, Saved
from maxattn._src.cp.spec import max_nan, pmax_nan
from maxattn._src.warn import warn_once


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


def _factors(name: str, shape: tuple) -> list[str]:
    """The logical factor of each axis of the array `name` ("" = its own, unsharded factor)."""
    spec = FIELDS[name].factors
    if spec == "*":  # broadcastable [b', n', t', s']
        return ["" if d == 1 else f for d, f in zip(shape, ("b", "n", "t", "s"))]
    return ["" if f in ("_", "h", "d") else f for f in spec.split()]


@dataclasses.dataclass(frozen=True)
class _Plan:
    """How the call is laid out on the mesh: the mesh axes of each logical factor."""

    batch: tuple
    heads: tuple
    kv_heads: tuple
    seq: tuple       # () or (cp_axis,)
    cp_size: int

    def spec(self, name: str, shape: tuple) -> P:
        axes = {"b": self.batch, "t": self.seq, "s": self.seq, "n": self.heads, "k": self.kv_heads}
        return P(*(_spec_entry(axes[f]) if f else None for f in _factors(name, shape)))


def _make_plan(mesh, call: Call, query_sharding, cp: Optional[cp_lib.ContextParallel], what: str) -> _Plan:
    K = call.num_kv_heads
    if not isinstance(query_sharding, NamedSharding):
        warn_once(f"maxattn: {what}: the mesh axis names of the input sharding are unknown "
                  f"({type(query_sharding).__name__}); running it replicated. Use NamedSharding inputs "
                  "or call under `with mesh:`.")
        return _Plan((), (), (), (), 1)
    spec = tuple(query_sharding.spec) + (None,) * (4 - len(query_sharding.spec))
    batch, seq, heads, hdim = (_axes(e) for e in spec)
    size = lambda axes: math.prod(mesh.shape[a] for a in axes)
    cp_size = 1
    if cp is not None:
        if cp.axis not in mesh.axis_names:
            raise ValueError(f"context_parallel_axis={cp.axis!r} is not an axis of the mesh "
                             f"{tuple(mesh.axis_names)}")
        if cp.axis in batch or cp.axis in heads:
            warn_once(f"maxattn: {what}: mesh axis {cp.axis!r} is the context-parallel axis but also shards "
                      "the batch or heads of `query`; resharding so that it shards the sequence only")
            batch = tuple(a for a in batch if a != cp.axis)
            heads = tuple(a for a in heads if a != cp.axis)
        if set(seq) - {cp.axis}:
            warn_once(f"maxattn: {what}: the sequence of `query` is sharded over {seq}; with "
                      f"context_parallel only {cp.axis!r} may shard it; resharding")
        cp_size = mesh.shape[cp.axis]
        seq = (cp.axis,) if cp_size > 1 else ()
        cp_lib.check_sizes(cp, cp_size, call.q_len, call.kv_len)
    elif seq:
        warn_once(f"maxattn: {what}: the sequence axis of `query` is sharded over mesh axes {seq} but "
                  "context_parallel is not set, so it is gathered (replicated) for attention; pass "
                  "context_parallel='all_gather' or 'ring' with context_parallel_axis to shard attention "
                  "over the sequence")
        seq = ()
    if hdim:
        warn_once(f"maxattn: {what}: the head_dim axis of `query` is sharded over {hdim}; it is gathered")
    tp = size(heads)
    if tp == 1:
        kv_heads = ()
    elif K % tp == 0:
        kv_heads = heads
    elif K == 1:
        kv_heads = ()
    else:
        warn_once(f"maxattn: {what}: query heads are sharded {tp}-way over {heads} but the {K} kv heads are "
                  f"not divisible by {tp}; replicating the heads (shard heads over a divisor of K={K})")
        heads = kv_heads = ()
    return _Plan(batch, heads, kv_heads, seq, cp_size)


def _sharding_rule(call: Call, arg_names, arg_shapes, res_names, res_shapes) -> tuple[str, dict]:
    """Einsum-like Shardy rule. Query heads are the compound factor (k g) so that TP
    shards q and kv heads together; with a single kv head (MQA) they are their own factor."""
    G, K = call.group, call.num_kv_heads
    heads = "k" if G == 1 else ("n" if K == 1 else "(k g)")
    uniq = iter(f"u{i}" for i in range(256))
    names = {"b": "b", "t": "t", "s": "s", "n": heads, "k": "k", "h": "h", "d": "d"}

    def term(name, shape):
        if not shape:
            return ""
        raw = FIELDS[name].factors
        if raw == "*":
            return " ".join(next(uniq) if d == 1 else names[f] for d, f in zip(shape, ("b", "n", "t", "s")))
        return " ".join(names[f] if f in names else next(uniq) for f in raw.split())

    lhs = ", ".join(term(n, s) for n, s in zip(arg_names, arg_shapes))
    rhs = ", ".join(term(n, s) for n, s in zip(res_names, res_shapes))
    return f"{lhs} -> {rhs}", ({"g": G} if heads == "(k g)" else {})


def _seed_with_offsets(call: Call, plan: _Plan) -> Call:
    """Adds this shard's global (batch, head) offset to words 2, 3 of the dropout seed,
    so that every shard draws its part of the unsharded call's mask."""
    seed = call.operands.dropout_seed
    if seed is None or not (plan.batch or plan.heads):
        return call
    if plan.batch:
        seed = seed.at[2].add(jax.lax.axis_index(plan.batch).astype(jnp.uint32) * jnp.uint32(call.batch))
    if plan.heads:
        seed = seed.at[3].add(jax.lax.axis_index(plan.heads).astype(jnp.uint32) * jnp.uint32(call.num_heads))
    return call.replace(dropout_seed=seed)


# ----------------------------------------------------------------------------
# One custom_partitioning function per (direction, options, operand layout).


class _Layout(NamedTuple):
    """The present arrays of one call: names ("saved." for backward inputs) and shapes."""

    names: tuple
    shapes: tuple


def _flatten(call: Call, saved: Optional[Saved]):
    names, arrays = [], []
    records = [("", call.operands)] + ([("saved.", saved)] if saved is not None else [])
    for prefix, rec in records:
        for name, x in zip(rec._fields, rec):
            if x is not None:
                names.append(prefix + name)
                arrays.append(x)
    return _Layout(tuple(names), tuple(tuple(a.shape) for a in arrays)), arrays


def _unflatten(options, layout: _Layout, arrays) -> tuple[Call, Optional[Saved]]:
    ops, sv = {}, {}
    for name, a in zip(layout.names, arrays):
        (sv if name.startswith("saved.") else ops)[name.removeprefix("saved.")] = a
    return Call(options, Operands(**ops)), (Saved(**sv) if sv else None)


def _field(name: str) -> str:
    return name.removeprefix("saved.")


def _result_fields(call: Call, forward: bool) -> tuple[str, ...]:
    """The result fields the partitioned function returns (present ones only), named as in
    `call.FIELDS` (max_logit reduced over the batch is "max_logit_over_batch")."""
    if forward:
        mx = "max_logit_over_batch" if call.options.max_logit_over_batch else "max_logit"
        return ("out",) + (("lse",) if call.options.lse else ()) + ((mx,) if call.options.max_logit else ())
    ops = call.operands
    return ("dq", "dk", "dv") + (("dbias",) if ops.bias is not None else ()) + \
        (("dsink",) if ops.sink_logits is not None else ())


def _result_shape(call: Call, field: str) -> tuple:
    ops = call.operands
    B, T, N = ops.query.shape[:3]
    return {"out": (B, T, N, ops.value.shape[3]), "lse": (B, N, T), "max_logit": (B, N),
            "max_logit_over_batch": (1, N), "dq": ops.query.shape,
            "dk": ops.key.shape, "dv": ops.value.shape, "dsink": (B, N),
            "dbias": None if ops.bias is None else ops.bias.shape}[field]


@functools.cache
def _partitioned_fn(backend, cp, options, layout: _Layout, forward: bool) -> Callable:
    probe, _ = _unflatten(options, layout, [jax.ShapeDtypeStruct(s, jnp.float32) for s in layout.shapes])
    res_fields = _result_fields(probe, forward)
    res_shapes = [_result_shape(probe, f) for f in res_fields]
    what = "attention forward" if forward else "attention backward"

    def run(call: Call, saved: Optional[Saved]):
        return backend.forward(call) if forward else backend.backward(call, saved)

    def present(res):
        return tuple(getattr(res, f.removesuffix("_over_batch")) for f in res_fields)

    def global_fn(*arrays):
        call, saved = _unflatten(options, layout, arrays)
        res = run(call, saved)
        return present(_max_logit_over_batch(res, call, ()) if forward else res)

    def specs(plan: _Plan, names, shapes):
        return tuple(plan.spec(_field(n), s) for n, s in zip(names, shapes))

    def per_device(plan: _Plan, *arrays):
        call, saved = _unflatten(options, layout, arrays)
        call = _seed_with_offsets(call, plan)
        if cp is not None and plan.cp_size > 1:
            res = cp_lib.forward(backend, call, cp, plan.cp_size) if forward else \
                cp_lib.backward(backend, call, cp, plan.cp_size, saved)
        else:
            res = run(call, saved)
        res = _max_logit_over_batch(res, call, plan.batch) if forward else _reduce_grads(res, plan, call)
        return present(res)

    fn = custom_partitioning(global_fn)

    def plan_of(mesh, arg_shapes):
        return _make_plan(mesh, probe, arg_shapes[0].sharding, cp, what)

    def infer(mesh, arg_shapes, result_shape):
        return tuple(NamedSharding(mesh, s) for s in specs(plan_of(mesh, arg_shapes), res_fields, res_shapes))

    def partition(mesh, arg_shapes, result_shape):
        plan = plan_of(mesh, arg_shapes)
        arg_shardings = tuple(NamedSharding(mesh, s) for s in specs(plan, layout.names, layout.shapes))

        def lower(*arrays):
            with _no_abstract_mesh():
                return per_device(plan, *arrays)

        return mesh, lower, infer(mesh, arg_shapes, result_shape), arg_shardings

    rule, sizes = _sharding_rule(probe, [_field(n) for n in layout.names], layout.shapes, res_fields, res_shapes)
    fn.def_partition(partition, infer_sharding_from_operands=infer, sharding_rule=rule, **sizes)
    return fn


def _max_logit_over_batch(res: Fwd, call: Call, batch_axes: tuple) -> Fwd:
    """With `options.max_logit_over_batch`: max_logit [B, N] -> [1, N] over this device's rows
    (unless the backend reduced them) and over the mesh axes that shard the batch; NaN propagates."""
    mx = res.max_logit
    if mx is None or not call.options.max_logit_over_batch:
        return res
    if mx.shape[0] != 1:
        mx = max_nan(mx, axis=0, keepdims=True)
    if batch_axes:
        mx = pmax_nan(mx, batch_axes)
    return res._replace(max_logit=mx)


def _reduce_grads(g: Grads, plan: _Plan, call: Call) -> Grads:
    """Sums over the devices what each holds only part of."""
    dk, dv, db = g.dk, g.dv, g.dbias
    if plan.heads and not plan.kv_heads:
        # MQA with sharded query heads: each device holds part of the kv-head gradient.
        dk = jax.lax.psum(dk.astype(jnp.float32), plan.heads).astype(dk.dtype)
        dv = jax.lax.psum(dv.astype(jnp.float32), plan.heads).astype(dv.dtype)
    if db is not None:
        bias_shape = call.operands.bias.shape
        axes = (plan.batch if bias_shape[0] == 1 else ()) + (plan.heads if bias_shape[1] == 1 else ())
        if axes:
            db = jax.lax.psum(db, axes)
    return g._replace(dk=dk, dv=dv, dbias=db)


class Partitioned:
    """A backend whose forward / backward are custom-partitioned (same contract)."""

    def __init__(self, backend, cp: Optional[cp_lib.ContextParallel]):
        self.backend = backend
        self.cp = cp

    def forward(self, call: Call) -> Fwd:
        layout, arrays = _flatten(call, None)
        res = _partitioned_fn(self.backend, self.cp, call.options, layout, True)(*arrays)
        it = iter(res)
        return Fwd(next(it), next(it) if call.options.lse else None, next(it) if call.options.max_logit else None)

    def backward(self, call: Call, saved: Saved) -> Grads:
        layout, arrays = _flatten(call, saved)
        res = iter(_partitioned_fn(self.backend, self.cp, call.options, layout, False)(*arrays))
        ops = call.operands
        return Grads(next(res), next(res), next(res), next(res) if ops.bias is not None else None,
                     next(res) if ops.sink_logits is not None else None)

"""vmap support for the per-device backends by folding mapped axes into the batch.

A backend sees only [B, ...] buffers. Under `jax.vmap` we fold the mapped
axis V into the batch axis (V*B), call the same function once, and unfold the
results. max_logit is asked per (batch, head) from the folded call, so each
mapped instance keeps its own maximum after unfolding; where the call wants it
over the batch ([1, N]), the rule reduces each instance's rows itself. Nested
vmaps fold recursively. The role of each array's axis 0 comes from `call.FIELDS`.

Operands without a batch axis (REPL: the per-head sink logits, the dropout
seed) are passed through unchanged when they are not mapped. When one of them
IS mapped (e.g. vmap over dropout keys or per-layer sinks), the instances
cannot share one call: the rule then runs the call once per mapped instance
with `jax.lax.map` (sequential over the mapped axis).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap

from maxattn._src.call import BATCH, BCAST, FIELDS, REPL, Call, Operands, Saved
from maxattn._src.cp.spec import max_nan


def _present(call: Call, saved: Optional[Saved]) -> tuple[tuple[str, ...], list]:
    """Names (prefixed "saved." for the backward inputs) and arrays of what is not None."""
    names, arrays = [], []
    for name, x in zip(call.operands._fields, call.operands):
        if x is not None:
            names.append(name)
            arrays.append(x)
    if saved is not None:
        for name, x in zip(saved._fields, saved):
            if x is not None:
                names.append("saved." + name)
                arrays.append(x)
    return tuple(names), arrays


def _rebuild(names: tuple[str, ...], arrays, saved_type) -> tuple[dict, Optional[Saved]]:
    ops, sv = {}, {}
    for name, a in zip(names, arrays):
        if name.startswith("saved."):
            sv[name[6:]] = a
        else:
            ops[name] = a
    return ops, (saved_type(**sv) if saved_type is not None else None)


def _role(name: str) -> str:
    return FIELDS[name.removeprefix("saved.")].role


def fold(fn: Callable[..., NamedTuple]) -> Callable[..., NamedTuple]:
    """Wraps `fn(call[, saved]) -> result record` with a vmap rule that folds.

    The result record's fields are arrays whose axis 0 is the batch, or None;
    a BCAST result (dbias) takes the batch size of the operand of the same
    role (the bias): it is summed over the folded batch when the bias was
    broadcast over it.
    """
    cache: dict[Any, Callable] = {}

    def get(options, names: tuple[str, ...], with_saved: bool) -> Callable:
        key = (options, names, with_saved)
        if key not in cache:
            cache[key] = build(options, names, with_saved)
        return cache[key]

    def build(options, names: tuple[str, ...], with_saved: bool) -> Callable:
        roles = [_role(n) for n in names]
        saved_type = Saved if with_saved else None
        result_type: list = []

        def call_fn(*arrays):
            ops, saved = _rebuild(names, arrays, saved_type)
            res = fn(Call(options, Operands(**ops)), *(() if saved is None else (saved,)))
            if not result_type:
                result_type.append(type(res))
            return tuple(res)

        wrapped = custom_vmap(call_fn)

        @wrapped.def_vmap
        def rule(axis_size, in_batched, *arrays):
            if any(b and r == REPL for b, r in zip(in_batched, roles)):
                mapped = [a for a, b in zip(arrays, in_batched) if b]

                def one(xs):
                    it = iter(xs)
                    return wrapped(*[next(it) if b else a for a, b in zip(arrays, in_batched)])

                outs = tuple(jax.lax.map(one, mapped))
                return outs, _batched_spec(outs)
            first = arrays[0]
            batch = first.shape[1] if in_batched[0] else first.shape[0]
            folded = []
            for a, batched, role in zip(arrays, in_batched, roles):
                if role == REPL:  # not mapped (else the lax.map path above)
                    folded.append(a)
                    continue
                if not batched:
                    a = a[None]
                rest = a.shape[2:]
                a = jnp.broadcast_to(a, (axis_size, batch) + rest)
                folded.append(a.reshape((axis_size * batch,) + rest))
            # max_logit over the batch: the folded call returns rows, reduced per instance below.
            over_batch = options.max_logit_over_batch
            inner = get(options.replace(max_logit_over_batch=False), names, with_saved).wrapped if over_batch \
                else wrapped
            outs = inner(*folded)
            fields = result_type[0]._fields if result_type else (None,) * len(outs)
            unfolded = []
            for o, field in zip(outs, fields):
                if o is None:
                    unfolded.append(None)
                    continue
                o = o.reshape((axis_size, batch) + o.shape[1:])
                if field == "max_logit" and over_batch:
                    o = max_nan(o, axis=1, keepdims=True)
                if field is not None and FIELDS[field].role == BCAST:
                    # Summed over the batch when the operand it mirrors was broadcast over it.
                    src = names.index("bias")
                    size0 = arrays[src].shape[1] if in_batched[src] else arrays[src].shape[0]
                    if size0 == 1 and batch != 1:
                        o = jnp.sum(o, axis=1, keepdims=True)
                unfolded.append(o)
            return tuple(unfolded), _batched_spec(unfolded)

        def run(arrays):
            outs = wrapped(*arrays)  # traces call_fn first, which records the result type
            return result_type[0](*outs)

        run.wrapped = wrapped
        return run

    def folded(call: Call, saved: Optional[Saved] = None):
        names, arrays = _present(call, saved)
        return get(call.options, names, saved is not None)(arrays)

    return folded


def _batched_spec(outs) -> tuple:
    """custom_vmap's out_batched for `outs`: True per array, None for an absent (None)
    output, so that the spec has the same tree structure as the values."""
    return tuple(None if o is None else True for o in outs)


__all__ = ["fold", "BATCH", "BCAST", "REPL"]

"""vmap support for the FFI backends by folding mapped axes into the batch.

An FFI call sees only [B, ...] buffers. Under `jax.vmap` we fold the mapped
axis V into the batch axis (V*B), call the same function once, and unfold the
results; max_logit is returned per (batch, head) by every backend, so each
mapped instance keeps its own maximum after unfolding. Nested vmaps fold
recursively.

Operands without a batch axis (REPL: the per-head sink logits, the dropout
seed) are passed through unchanged when they are not mapped. When one of them
IS mapped (e.g. vmap over dropout keys or per-layer sinks), the instances
cannot share one call: the rule then runs the call once per mapped instance
with `jax.lax.map` (sequential over the mapped axis).
"""

from __future__ import annotations

from typing import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.custom_batching import custom_vmap

# Roles of an operand's axis 0.
BATCH = "batch"  # axis 0 is the batch B
BCAST = "bcast"  # axis 0 is 1 (broadcast over the batch) or B
REPL = "repl"    # no batch axis (same for every batch row)


def _batched_spec(outs) -> tuple:
    """custom_vmap's out_batched for `outs`: True per array, None for an absent (None)
    output, so that the spec has the same tree structure as the values."""
    return tuple(None if o is None else True for o in outs)


def fold_into_batch(fn: Callable, in_roles: Sequence[str], out_reduce: Sequence[int | None]) -> Callable:
    """Wraps `fn(*arrays) -> tuple of arrays` with a vmap rule that folds.

    Args:
      fn: takes len(in_roles) arrays (None allowed for absent operands) and
        returns a tuple of arrays whose axis 0 is the batch.
      in_roles: BATCH or BCAST for each argument. Argument 0 must be BATCH.
      out_reduce: for each output, None (axis 0 is the batch) or the index of
        a BCAST input whose axis-0 size the output takes (e.g. dbias is
        summed over the batch when its bias was broadcast over it).
    """
    present_cache: dict[tuple[bool, ...], Callable] = {}

    def build(present: tuple[bool, ...]) -> Callable:
        roles = [r for r, p in zip(in_roles, present) if p]
        index = [i for i, p in enumerate(present) if p]

        def call(*arrays):
            full = [None] * len(in_roles)
            for i, a in zip(index, arrays):
                full[i] = a
            return tuple(fn(*full))

        wrapped = custom_vmap(call)

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
                if a is None:
                    folded.append(None)
                    continue
                if role == REPL:  # not mapped (else the lax.map path above)
                    folded.append(a)
                    continue
                if not batched:
                    a = a[None]
                rest = a.shape[2:]
                a = jnp.broadcast_to(a, (axis_size, batch) + rest)
                folded.append(a.reshape((axis_size * batch,) + rest))
            outs = wrapped(*folded)
            unfolded = []
            for o, reduce_from in zip(outs, out_reduce):
                if o is None:
                    unfolded.append(None)
                    continue
                o = o.reshape((axis_size, batch) + o.shape[1:])
                if reduce_from is not None:
                    src = arrays[index.index(reduce_from)]
                    size0 = src.shape[1] if in_batched[index.index(reduce_from)] else src.shape[0]
                    if size0 == 1 and batch != 1:
                        o = jnp.sum(o, axis=1, keepdims=True)
                unfolded.append(o)
            return tuple(unfolded), _batched_spec(unfolded)

        return wrapped

    def folded_fn(*arrays):
        present = tuple(a is not None for a in arrays)
        if present not in present_cache:
            present_cache[present] = build(present)
        return present_cache[present](*[a for a in arrays if a is not None])

    return folded_fn

"""Causal load balancing for context parallelism (the "dual-chunk" layout).

With causal attention and a plain contiguous split of the sequence over `cp`
ranks, rank r's queries see r+1 key blocks: the last rank does ~2x the average
work. The dual-chunk layout cuts the sequence into 2*cp chunks and gives rank r
chunks r and 2*cp-1-r, so every rank does the same amount of causal work.

`reorder_for_load_balancing` permutes a global array into that layout (so that
a plain contiguous sharding of the permuted axis over the cp mesh axis hands
rank r its two chunks); `inverse_reorder_for_load_balancing` undoes it.
"""

from __future__ import annotations

import numpy as np

import jax
import jax.numpy as jnp


def chunk_order(cp_size: int) -> np.ndarray:
    """Chunk ids in reordered order: [0, 2cp-1, 1, 2cp-2, ..., cp-1, cp]."""
    order = []
    for r in range(cp_size):
        order += [r, 2 * cp_size - 1 - r]
    return np.asarray(order, dtype=np.int32)


def _check(x, cp_size, axis, name):
    if isinstance(cp_size, bool) or not isinstance(cp_size, (int, np.integer)) or cp_size < 1:
        raise ValueError(f"`cp_size` must be a positive int, got {cp_size!r}")
    if isinstance(axis, bool) or not isinstance(axis, (int, np.integer)):
        raise TypeError(f"`axis` must be an int, got {type(axis).__name__}")
    x = jnp.asarray(x)
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"{name}: `axis`={axis} is out of range for an array of rank {x.ndim}")
    axis = int(axis) % x.ndim
    n = x.shape[axis]
    if n % (2 * cp_size) != 0:
        raise ValueError(f"{name}: the size {n} of axis {axis} must be divisible by 2 * cp_size = "
                         f"{2 * cp_size} (the dual-chunk layout cuts it into 2 * cp_size chunks)")
    return x, int(cp_size), axis


def _permute_chunks(x, cp_size, axis, order):
    n = x.shape[axis]
    c = n // (2 * cp_size)
    shape = x.shape[:axis] + (2 * cp_size, c) + x.shape[axis + 1:]
    xc = x.reshape(shape)
    xc = jnp.take(xc, jnp.asarray(order), axis=axis)
    return xc.reshape(x.shape)


def reorder_for_load_balancing(x: jax.Array, cp_size: int, axis: int = 1) -> jax.Array:
    """Permutes the sequence axis of `x` into the load-balanced dual-chunk layout.

    The axis (size divisible by 2 * cp_size) is cut into 2 * cp_size equal
    chunks and reordered as [0, 2cp-1, 1, 2cp-2, ..., cp-1, cp], so that when
    the result is sharded contiguously over a context-parallel mesh axis of
    size cp_size, rank r holds chunks r and 2*cp_size-1-r. Apply it to query,
    key, value (axis 1) and segment ids (axis 1) before calling
    `dot_product_attention(..., context_parallel=..., load_balanced=True)`, and
    `inverse_reorder_for_load_balancing` to the output (axis 1) and lse (axis 2).
    """
    x, cp_size, axis = _check(x, cp_size, axis, "reorder_for_load_balancing")
    return _permute_chunks(x, cp_size, axis, chunk_order(cp_size))


def inverse_reorder_for_load_balancing(x: jax.Array, cp_size: int, axis: int = 1) -> jax.Array:
    """The inverse of `reorder_for_load_balancing` (back to natural order)."""
    x, cp_size, axis = _check(x, cp_size, axis, "inverse_reorder_for_load_balancing")
    return _permute_chunks(x, cp_size, axis, np.argsort(chunk_order(cp_size)).astype(np.int32))

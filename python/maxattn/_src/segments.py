"""Packed sequences as a ragged layout: segment ids -> per-segment lengths and offsets, in O(T).

A row of packed documents is described by segment ids (one int per token, 0 =
padding). A kernel that skips cross-document work wants, instead of a dense
[T, S] visibility, the list of segments of each row: where each starts and how
long it is, for the queries and for the keys. This module computes that list
on the device with a static bound `max_segments` on the segments per row
(the count itself is a traced value), and checks the two conditions under
which the ragged form means the same as the segment-id rule of the contract:

* every segment is one contiguous run: a row like 1,1,2,2,1 (id 1 twice, with
  another segment between) is *not* a ragged layout -- the dense rule lets
  the two runs of id 1 see each other, a ragged kernel would not;
* the query and key rows list the same segments in the same order (segment m
  of the queries attends segment m of the keys only);
* a row has at most `max_segments` segments.

`ragged_layout` returns these checks as a boolean per row, so the caller can
decide between refusing (a run-time error) and falling back. It is the O(T)
first step for the cuDNN ragged-offset path and our own kernels' segment
skipping (issues 17, 14); nothing calls it on the hot path yet.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp


class RaggedRows(NamedTuple):
    """The segments of each row of a [B, T] segment-id array, at most M per row.

    start, length: int32 [B, M], position of the first token and token count of
    the m-th segment (in order of appearance); 0 / 0 past the row's count.
    ids: int32 [B, M], the id of each segment (0 past the count).
    count: int32 [B], segments in the row (may exceed M: then `fits` is False).
    contiguous: bool [B], no id appears in two separate runs.
    fits: bool [B], count <= M.
    """

    start: jax.Array
    length: jax.Array
    ids: jax.Array
    count: jax.Array
    contiguous: jax.Array
    fits: jax.Array


def segment_rows(segment_ids: jax.Array, max_segments: int) -> RaggedRows:
    """The runs of equal non-zero ids of every row (O(B * T) work and memory)."""
    if segment_ids.ndim != 2:
        raise ValueError(f"segment ids must have shape [B, T], got {segment_ids.shape}")
    if not isinstance(max_segments, int) or max_segments < 1:
        raise ValueError(f"`max_segments` must be a positive int, got {max_segments!r}")
    ids = segment_ids.astype(jnp.int32)
    B, T = ids.shape
    M = max_segments
    prev = jnp.concatenate([jnp.zeros((B, 1), jnp.int32), ids[:, :-1]], axis=1)
    starts = (ids != prev) & (ids != 0)
    count = jnp.sum(starts, axis=1, dtype=jnp.int32)
    run = jnp.cumsum(starts, axis=1, dtype=jnp.int32) - 1  # index of the run each token belongs to
    in_run = (ids != 0) & (run < M)
    slot = jnp.where(in_run, run, M)  # M: a dump slot dropped below
    rows = jnp.broadcast_to(jnp.arange(B, dtype=jnp.int32)[:, None], (B, T))
    pos = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32)[None, :], (B, T))
    length = jnp.zeros((B, M + 1), jnp.int32).at[rows, slot].add(in_run.astype(jnp.int32))[:, :M]
    start_slot = jnp.where(starts & in_run, slot, M)
    start = jnp.zeros((B, M + 1), jnp.int32).at[rows, start_slot].set(pos)[:, :M]
    seg_ids = jnp.zeros((B, M + 1), jnp.int32).at[rows, start_slot].set(ids)[:, :M]
    # Contiguous iff no id repeats among the row's runs: sort the run ids (M is small).
    live = jnp.arange(M, dtype=jnp.int32)[None, :] < jnp.minimum(count, M)[:, None]
    key = jnp.sort(jnp.where(live, seg_ids, -1 - jnp.arange(M, dtype=jnp.int32)[None, :]), axis=1)
    contiguous = ~jnp.any((key[:, 1:] == key[:, :-1]) & (key[:, 1:] >= 0), axis=1)
    return RaggedRows(start, length, seg_ids, count, contiguous, count <= M)


class RaggedLayout(NamedTuple):
    """Query and key segments paired for a ragged kernel (see `ragged_layout`)."""

    q: RaggedRows
    kv: RaggedRows
    valid: jax.Array  # bool [B]: both contiguous, both fit, and the same segment ids in order


def ragged_layout(q_segment_ids: jax.Array, kv_segment_ids: jax.Array, max_segments: int) -> RaggedLayout:
    """The paired ragged layout of a packed call, and whether each row can use it."""
    q = segment_rows(q_segment_ids, max_segments)
    kv = segment_rows(kv_segment_ids, max_segments)
    same = (q.count == kv.count) & jnp.all(q.ids == kv.ids, axis=1)
    return RaggedLayout(q, kv, q.contiguous & kv.contiguous & q.fits & kv.fits & same)

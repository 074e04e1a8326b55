"""The call record: what one attention call is, from the public API down to the kernels.

`canonicalize` (canonicalize.py) builds one `Call` per public call:

* `Call.options` (`Options`, frozen and hashable): every static choice -- the
  scale, the `Mask` (causal, alignment, window), soft cap, dropout rate, the
  softmax type and which optional results are requested. Presence of an
  optional array is *not* repeated here: it is `Call.operands.<name> is not None`.
* `Call.operands` (`Operands`): the arrays in canonical form, None when absent.

`Call` is a pytree (options are static metadata), so it passes through
`custom_vjp`, `custom_vmap` and `custom_partitioning` as one value. Every
backend receives a `Call` and returns a fixed result record: `Fwd` from the
forward, `Grads` from the backward (fields are None where absent; no tuple
whose length depends on flags).

`FIELDS` is the single table of each array's axes: the vmap-fold role of axis
0 (batching.py) and the logical factors of its axes, from which the
partitioner derives both the Shardy rule and the PartitionSpecs.
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, NamedTuple, Optional

import jax
import numpy as np


# The largest max_segments (kMaxSegmentsPerRow of csrc/maxattn/attention.h, which
# validates it again; tests/python/test_ragged_layout.py checks both agree).
MAX_SEGMENTS_PER_ROW = 1024


class Alignment(enum.Enum):
    """Where the causal diagonal (and the window's centre) sits when T != S."""

    TOP_LEFT = "top_left"          # key j visible to query i iff j <= i
    BOTTOM_RIGHT = "bottom_right"  # iff j <= i + kv_len - q_len (valid lengths)


class SoftmaxType(enum.Enum):
    VANILLA = "vanilla"
    OFF_BY_ONE = "off_by_one"  # a sink logit of 0 for every head
    LEARNABLE = "learnable"    # a sink logit per head, given by the caller


@dataclasses.dataclass(frozen=True)
class Mask:
    """The static part of the visibility rule (arrays -- lengths, segment ids, a
    dense mask -- are operands). Window bounds are -1 when unbounded."""

    causal: bool = False
    alignment: Alignment = Alignment.TOP_LEFT
    window_left: int = -1
    window_right: int = -1

    @property
    def bottom_right(self) -> bool:
        return self.alignment is Alignment.BOTTOM_RIGHT

    @property
    def windowed(self) -> bool:
        return self.window_left >= 0 or self.window_right >= 0


@dataclasses.dataclass(frozen=True)
class Options:
    """Static options of one call. `lse` / `max_logit`: the optional results requested."""

    scale: float
    mask: Mask = Mask()
    softcap: float = 0.0  # 0: no soft cap
    dropout_rate: float = 0.0
    softmax: SoftmaxType = SoftmaxType.VANILLA
    lse: bool = False
    max_logit: bool = False
    # max_logit over the whole batch, [1, N], instead of per batch row, [B, N]. A backend may
    # reduce in its kernel (sm90: one atomic max per head) or return [B, N]; the partitioner
    # reduces what is left (partition.py), and the vmap fold asks for rows (batching.py).
    max_logit_over_batch: bool = False
    # > 0: the caller's promise that each row of the segment ids is at most this
    # many contiguous segments, the same ones in the same order for queries and
    # keys (segments.py); a backend may then run them as ragged sequences.
    max_segments: int = 0
    # The backward sums every gradient in a fixed order (bit-identical runs).
    deterministic: bool = False

    def replace(self, **changes: Any) -> "Options":
        return dataclasses.replace(self, **changes)

    def with_mask(self, **changes: Any) -> "Options":
        return dataclasses.replace(self, mask=dataclasses.replace(self.mask, **changes))

    def ffi_attributes(self) -> dict[str, Any]:
        """The attributes of every FFI target: exactly the members of the C++
        `maxattn::AttentionOptions` (decoded as one struct, csrc/ffi/options_attr.h).
        Which optional operands and results exist is told by the buffers."""
        return dict(
            scale=np.float32(self.scale),
            causal=bool(self.mask.causal),
            alignment=np.int32(1 if self.mask.bottom_right else 0),
            window_left=np.int64(self.mask.window_left),
            window_right=np.int64(self.mask.window_right),
            softcap=np.float32(self.softcap),
            dropout_rate=np.float32(self.dropout_rate),
            max_segments=np.int64(self.max_segments),
            deterministic=bool(self.deterministic),
        )


class Operands(NamedTuple):
    """The arrays of one call in canonical form; absent optional operands are None.

    query [B, T, N, H], key [B, S, K, H], value [B, S, K, Hv] (one float dtype);
    bias [b', n', t', s'] (each dim 1 or full, float); mask likewise, bool;
    q_seq_lengths / kv_seq_lengths int32 [B]; q/kv_segment_ids int32 [B, T] / [B, S];
    sink_logits float32 [N] iff softmax != vanilla; dropout_seed uint32 [4] iff
    dropout_rate > 0 (csrc/maxattn/dropout.h).
    """

    query: jax.Array
    key: jax.Array
    value: jax.Array
    bias: Optional[jax.Array] = None
    mask: Optional[jax.Array] = None
    q_seq_lengths: Optional[jax.Array] = None
    kv_seq_lengths: Optional[jax.Array] = None
    q_segment_ids: Optional[jax.Array] = None
    kv_segment_ids: Optional[jax.Array] = None
    sink_logits: Optional[jax.Array] = None
    dropout_seed: Optional[jax.Array] = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Call:
    """One attention call: static options plus operand arrays (a pytree)."""

    options: Options = dataclasses.field(metadata=dict(static=True))
    operands: Operands

    def replace(self, options: Optional[Options] = None, **operands: Any) -> "Call":
        """A copy with other options and/or some operands replaced."""
        ops = self.operands._replace(**operands) if operands else self.operands
        return Call(self.options if options is None else options, ops)

    # Sizes.
    @property
    def batch(self) -> int:
        return self.operands.query.shape[0]

    @property
    def q_len(self) -> int:
        return self.operands.query.shape[1]

    @property
    def kv_len(self) -> int:
        return self.operands.key.shape[1]

    @property
    def num_heads(self) -> int:
        return self.operands.query.shape[2]

    @property
    def num_kv_heads(self) -> int:
        return self.operands.key.shape[2]

    @property
    def dense_segments(self) -> bool:
        """Segment ids without the max_segments_per_row promise: the dense same-segment rule, which
        cuDNN can only take folded into an O(T*S) bias."""
        return self.operands.q_segment_ids is not None and self.options.max_segments == 0

    @property
    def head_dim(self) -> int:
        """Head dim of query and key (value's may differ)."""
        return self.operands.query.shape[3]

    @property
    def group(self) -> int:
        """Query heads per kv head (GQA)."""
        return self.num_heads // self.num_kv_heads if self.num_kv_heads else 1


class Fwd(NamedTuple):
    """Forward results. lse f32 [B, N, T] and max_logit f32 [B, N] (per batch row), or [1, N]
    (the max over the rows) when `options.max_logit_over_batch`, are None unless requested."""

    out: jax.Array
    lse: Optional[jax.Array] = None
    max_logit: Optional[jax.Array] = None


class Saved(NamedTuple):
    """What the backward reads besides the call: the forward's out and lse
    (including any sink) and the cotangents of out and lse (dlse None = zero)."""

    out: jax.Array
    lse: jax.Array
    dout: jax.Array
    dlse: Optional[jax.Array] = None


class Grads(NamedTuple):
    """Backward results: dq/dk/dv like q/k/v; dbias f32 of the bias's shape (None
    without a bias); dsink f32 [B, N] per batch row (None without a sink)."""

    dq: jax.Array
    dk: jax.Array
    dv: jax.Array
    dbias: Optional[jax.Array] = None
    dsink: Optional[jax.Array] = None


# ----------------------------------------------------------------------------
# The axes of every array that crosses the batching and partitioning layers.
#
# role: what axis 0 is -- "batch" (B), "bcast" (1 or B: broadcast over the
# batch), "repl" (no batch axis). factors: one logical name per axis --
#   b batch, t query sequence, s key sequence, n query heads, k kv heads,
#   h / d head dims (never sharded), "*" a broadcastable [b', n', t', s'] array
#   (each size-1 dim is its own factor), "_" a replicated unnamed axis.


class Axes(NamedTuple):
    role: str
    factors: str


BATCH, BCAST, REPL = "batch", "bcast", "repl"

FIELDS: dict[str, Axes] = {
    # Operands.
    "query": Axes(BATCH, "b t n h"),
    "key": Axes(BATCH, "b s k h"),
    "value": Axes(BATCH, "b s k d"),
    "bias": Axes(BCAST, "*"),
    "mask": Axes(BCAST, "*"),
    "q_seq_lengths": Axes(BATCH, "b"),
    "kv_seq_lengths": Axes(BATCH, "b"),
    "q_segment_ids": Axes(BATCH, "b t"),
    "kv_segment_ids": Axes(BATCH, "b s"),
    "sink_logits": Axes(REPL, "n"),
    "dropout_seed": Axes(REPL, "_"),
    # Saved (backward inputs).
    "out": Axes(BATCH, "b t n d"),
    "lse": Axes(BATCH, "b n t"),
    "dout": Axes(BATCH, "b t n d"),
    "dlse": Axes(BATCH, "b n t"),
    # Results.
    "max_logit": Axes(BATCH, "b n"),
    "max_logit_over_batch": Axes(REPL, "_ n"),  # max_logit under options.max_logit_over_batch: [1, N]
    "dq": Axes(BATCH, "b t n h"),
    "dk": Axes(BATCH, "b s k h"),
    "dv": Axes(BATCH, "b s k d"),
    "dbias": Axes(BCAST, "*"),  # like the bias
    "dsink": Axes(BATCH, "b n"),
}

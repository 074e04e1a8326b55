"""Argument checking and canonicalisation shared by every backend.

`canonicalize` turns the public arguments of `dot_product_attention` into a
hashable `AttentionConfig` (static options) and an `Operands` tuple (arrays in
canonical form: bias and mask rank 4, integers int32). Every user error is
raised here, at trace time, as ValueError/TypeError naming the argument.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

IMPLEMENTATIONS = ("cpu", "cudnn", "xla")
ALIGNMENTS = ("top_left", "bottom_right")
SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
SOFTMAX_TYPES = ("vanilla", "off_by_one", "learnable")


@dataclasses.dataclass(frozen=True)
class AttentionConfig:
    """Static (hashable) options of one attention call, after canonicalisation.

    Window bounds are -1 when unbounded; softcap is 0.0 when absent.
    dropout_rate is 0.0 without dropout (then there is no dropout seed operand);
    softmax_type is "vanilla", "off_by_one" (the sink_logits operand holds
    zeros) or "learnable" (sink_logits given by the caller, differentiable).
    """

    scale: float
    is_causal: bool
    bottom_right: bool
    window_left: int
    window_right: int
    softcap: float
    has_bias: bool
    has_mask: bool
    has_q_seq_lengths: bool
    has_kv_seq_lengths: bool
    has_segment_ids: bool
    dropout_rate: float = 0.0
    softmax_type: str = "vanilla"

    @property
    def has_dropout(self) -> bool:
        return self.dropout_rate > 0.0

    @property
    def has_sink(self) -> bool:
        return self.softmax_type != "vanilla"

    def ffi_attributes(self) -> dict[str, Any]:
        """The attributes every FFI target takes (see csrc/ffi/decode.h)."""
        return dict(
            scale=np.float32(self.scale),
            is_causal=bool(self.is_causal),
            bottom_right=bool(self.bottom_right),
            window_left=np.int64(self.window_left),
            window_right=np.int64(self.window_right),
            softcap=np.float32(self.softcap),
            has_bias=bool(self.has_bias),
            has_mask=bool(self.has_mask),
            has_q_seq_lengths=bool(self.has_q_seq_lengths),
            has_kv_seq_lengths=bool(self.has_kv_seq_lengths),
            has_segment_ids=bool(self.has_segment_ids),
            dropout_rate=np.float32(self.dropout_rate),
        )


class Operands(NamedTuple):
    """Arrays of one call in canonical form. Absent optional operands are None.

    query [B, T, N, H], key [B, S, K, H], value [B, S, K, Hv] (one float dtype);
    bias [b', n', t', s'] (each dim 1 or full, float); mask likewise, bool;
    q_seq_lengths / kv_seq_lengths int32 [B]; q/kv_segment_ids int32 [B, T] / [B, S].
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
    sink_logits: Optional[jax.Array] = None   # float32 [N] iff softmax_type != "vanilla"
    dropout_seed: Optional[jax.Array] = None  # uint32 [4] iff dropout_rate > 0 (see csrc/maxattn/dropout.h)




def _as_array(x: Any, name: str) -> jax.Array:
    if isinstance(x, (jax.Array, np.ndarray, np.generic)) or hasattr(x, "shape"):
        return jnp.asarray(x)
    raise TypeError(f"`{name}` must be an array, got {type(x).__name__}")


def _broadcast4(x: jax.Array, name: str, full: tuple[int, int, int, int]) -> jax.Array:
    """Left-pads `x` to rank 4 and checks every dim is 1 or the full size."""
    if x.ndim > 4:
        raise ValueError(f"`{name}` must have rank <= 4 (broadcastable to [B, N, T, S] = {list(full)}), "
                         f"got shape {x.shape}")
    shape = (1,) * (4 - x.ndim) + tuple(x.shape)
    for got, want, axis in zip(shape, full, "BNTS"):
        if got not in (1, want):
            raise ValueError(f"`{name}` of shape {x.shape} is not broadcastable to [B, N, T, S] = "
                             f"{list(full)}: axis {axis} has size {got}, expected 1 or {want}")
    return x.reshape(shape)


def _int_array(x: Any, name: str, shape: tuple[int, ...], what: str) -> jax.Array:
    x = _as_array(x, name)
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"`{name}` must have an integer dtype, got {x.dtype}")
    if tuple(x.shape) != shape:
        raise ValueError(f"`{name}` must have shape {what} = {list(shape)}, got {list(x.shape)}")
    return x.astype(jnp.int32)


def _check_bool(value: Any, name: str) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"`{name}` must be a Python bool, got {type(value).__name__}")
    return bool(value)


def _window(local_window_size: Any) -> tuple[int, int]:
    if local_window_size is None:
        return -1, -1
    if isinstance(local_window_size, (int, np.integer)) and not isinstance(local_window_size, bool):
        left = right = int(local_window_size)
    elif (isinstance(local_window_size, (tuple, list)) and len(local_window_size) == 2
          and all(isinstance(w, (int, np.integer)) and not isinstance(w, bool) for w in local_window_size)):
        left, right = (int(w) for w in local_window_size)
    else:
        raise TypeError("`local_window_size` must be an int or a (left, right) tuple of ints, "
                        f"got {local_window_size!r}")
    if left < 0 or right < 0:
        raise ValueError(f"`local_window_size` must be non-negative, got {local_window_size!r}")
    return left, right


def check_flags(implementation: Any, return_max_logit: Any, return_lse: Any) -> None:
    """Checks the options that do not depend on arrays."""
    if implementation is not None and implementation not in IMPLEMENTATIONS:
        raise ValueError(f"`implementation` must be None or one of {IMPLEMENTATIONS}, got {implementation!r}")
    _check_bool(return_max_logit, "return_max_logit")
    _check_bool(return_lse, "return_lse")


def _dropout(dropout_rate: Any, dropout_rng: Any) -> tuple[float, Optional[jax.Array]]:
    """Validates the dropout arguments; returns (rate, uint32 [4] seed or None)."""
    if isinstance(dropout_rate, bool) or not isinstance(dropout_rate, (int, float, np.floating, np.integer)):
        raise TypeError(f"`dropout_rate` must be a Python float, got {type(dropout_rate).__name__}")
    rate = float(dropout_rate)
    if not (0.0 <= rate < 1.0):
        raise ValueError(f"`dropout_rate` must be in [0, 1), got {dropout_rate}")
    if rate == 0.0:
        return 0.0, None
    if dropout_rng is None:
        raise ValueError("`dropout_rng` (a JAX PRNG key) is required when `dropout_rate` > 0")
    if not hasattr(dropout_rng, "dtype"):
        raise TypeError(f"`dropout_rng` must be a JAX PRNG key, got {type(dropout_rng).__name__}")
    typed = jnp.issubdtype(dropout_rng.dtype, jax.dtypes.prng_key)
    if typed:
        if dropout_rng.shape != ():
            raise ValueError(f"`dropout_rng` must be a single PRNG key (shape ()), got shape {dropout_rng.shape}")
    elif not (dropout_rng.dtype == jnp.uint32 and dropout_rng.shape == (2,)):
        raise TypeError("`dropout_rng` must be a JAX PRNG key (jax.random.key(...) or a raw uint32[2] "
                        f"jax.random.PRNGKey), got dtype {dropout_rng.dtype} and shape {dropout_rng.shape}")
    bits = jax.random.bits(dropout_rng, (2,), jnp.uint32)
    # Words 2, 3: the (batch, head) offset of a shard's block (0 here; see sharding.py).
    return rate, jnp.concatenate([bits, jnp.zeros((2,), jnp.uint32)])


def _softmax_type(softmax_type: Any, sink_logits: Any, N: int) -> Optional[jax.Array]:
    if softmax_type not in SOFTMAX_TYPES:
        raise ValueError(f"`softmax_type` must be one of {SOFTMAX_TYPES}, got {softmax_type!r}")
    if softmax_type != "learnable":
        if sink_logits is not None:
            raise ValueError(f'`sink_logits` is only used with softmax_type="learnable", got '
                             f"softmax_type={softmax_type!r}")
        return jnp.zeros((N,), jnp.float32) if softmax_type == "off_by_one" else None
    if sink_logits is None:
        raise ValueError('`sink_logits` (float32 [N]) is required with softmax_type="learnable"')
    sink = _as_array(sink_logits, "sink_logits")
    if not jnp.issubdtype(sink.dtype, jnp.floating):
        raise TypeError(f"`sink_logits` must have a floating dtype (float32), got {sink.dtype}")
    if tuple(sink.shape) != (N,):
        raise ValueError(f"`sink_logits` must have shape [N] = [{N}] (one per query head), got {list(sink.shape)}")
    return sink.astype(jnp.promote_types(sink.dtype, jnp.float32))


def canonicalize(query: Any, key: Any, value: Any, bias: Any = None, mask: Any = None, *,
                 scale: Optional[float] = None, is_causal: bool = False,
                 causal_alignment: str = "top_left", query_seq_lengths: Any = None,
                 key_value_seq_lengths: Any = None, q_segment_ids: Any = None,
                 kv_segment_ids: Any = None, local_window_size: Any = None,
                 logits_soft_cap: Optional[float] = None, dropout_rate: Any = 0.0,
                 dropout_rng: Any = None, softmax_type: Any = "vanilla",
                 sink_logits: Any = None) -> tuple[AttentionConfig, Operands]:
    """Validates the public arguments; returns the static config and canonical operands."""
    q = _as_array(query, "query")
    k = _as_array(key, "key")
    v = _as_array(value, "value")
    for name, x in (("query", q), ("key", k), ("value", v)):
        if x.ndim != 4:
            raise ValueError(f"`{name}` must have rank 4 ([B, T|S, heads, head_dim]), got shape {x.shape}")
    for name, x in (("query", q), ("key", k), ("value", v)):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            raise TypeError(f"`{name}` must have a floating dtype (float32, bfloat16 or float16), got {x.dtype}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"`query`, `key` and `value` must have the same dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    B, T, N, H = q.shape
    if k.shape[0] != B or v.shape[0] != B:
        raise ValueError(f"batch sizes differ: query {B}, key {k.shape[0]}, value {v.shape[0]}")
    S, K = k.shape[1], k.shape[2]
    if v.shape[1] != S:
        raise ValueError(f"`key` and `value` must have the same sequence length S, got {S} and {v.shape[1]}")
    if v.shape[2] != K:
        raise ValueError(f"`key` and `value` must have the same number of heads K, got {K} and {v.shape[2]}")
    if k.shape[3] != H:
        raise ValueError(f"`query` and `key` must have the same head dim H, got {H} and {k.shape[3]}")
    if K == 0 and N != 0 or (K > 0 and N % K != 0):
        raise ValueError(f"the number of query heads N={N} must be a multiple of the number of kv heads K={K}")

    full = (B, N, T, S)
    b = None
    if bias is not None:
        b = _as_array(bias, "bias")
        if not jnp.issubdtype(b.dtype, jnp.floating):
            raise TypeError(f"`bias` must have a floating dtype, got {b.dtype}")
        b = _broadcast4(b, "bias", full)
    m = None
    if mask is not None:
        m = _as_array(mask, "mask")
        if m.dtype != jnp.bool_:
            raise TypeError(f"`mask` must be a boolean array (True = attend), got dtype {m.dtype}")
        m = _broadcast4(m, "mask", full)

    qlen = None if query_seq_lengths is None else _int_array(query_seq_lengths, "query_seq_lengths", (B,), "[B]")
    kvlen = None if key_value_seq_lengths is None else _int_array(
        key_value_seq_lengths, "key_value_seq_lengths", (B,), "[B]")
    if (q_segment_ids is None) != (kv_segment_ids is None):
        missing = "kv_segment_ids" if kv_segment_ids is None else "q_segment_ids"
        raise ValueError(f"`q_segment_ids` and `kv_segment_ids` must be given together; `{missing}` is missing")
    qseg = kvseg = None
    if q_segment_ids is not None:
        qseg = _int_array(q_segment_ids, "q_segment_ids", (B, T), "[B, T]")
        kvseg = _int_array(kv_segment_ids, "kv_segment_ids", (B, S), "[B, S]")

    if scale is None:
        scale_value = 1.0 / math.sqrt(H) if H > 0 else 1.0
    else:
        if isinstance(scale, bool) or not isinstance(scale, (int, float, np.floating, np.integer)):
            raise TypeError(f"`scale` must be a Python float, got {type(scale).__name__}")
        scale_value = float(scale)
        if not math.isfinite(scale_value):
            raise ValueError(f"`scale` must be finite, got {scale_value}")
    causal = _check_bool(is_causal, "is_causal")
    if causal_alignment not in ALIGNMENTS:
        raise ValueError(f"`causal_alignment` must be one of {ALIGNMENTS}, got {causal_alignment!r}")
    left, right = _window(local_window_size)
    cap = 0.0
    if logits_soft_cap is not None:
        if isinstance(logits_soft_cap, bool) or not isinstance(logits_soft_cap, (int, float, np.floating, np.integer)):
            raise TypeError(f"`logits_soft_cap` must be a Python float, got {type(logits_soft_cap).__name__}")
        cap = float(logits_soft_cap)
        if not (cap > 0 and math.isfinite(cap)):
            raise ValueError(f"`logits_soft_cap` must be a finite float > 0, got {logits_soft_cap}")

    rate, seed = _dropout(dropout_rate, dropout_rng)
    sink = _softmax_type(softmax_type, sink_logits, N)

    config = AttentionConfig(
        scale=scale_value, is_causal=causal, bottom_right=causal_alignment == "bottom_right",
        window_left=left, window_right=right, softcap=cap, has_bias=b is not None,
        has_mask=m is not None, has_q_seq_lengths=qlen is not None,
        has_kv_seq_lengths=kvlen is not None, has_segment_ids=qseg is not None,
        dropout_rate=rate, softmax_type=softmax_type)
    return config, Operands(q, k, v, b, m, qlen, kvlen, qseg, kvseg, sink, seed)

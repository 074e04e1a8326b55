"""Argument checking and canonicalisation: the public arguments -> one `Call`.

`canonicalize` turns the arguments of `dot_product_attention` into the call
record (call.py): static `Options` and `Operands` in canonical form (bias and
mask rank 4, integers int32, the dropout key as Philox words, the sink logits
of "off_by_one" as zeros), plus the `ContextParallel` value. Every user error
is raised here, at trace time, as ValueError/TypeError naming the argument:
this module owns the user-facing rules; backends only say what they cannot run.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from maxattn._src import backends
from maxattn._src.call import MAX_SEGMENTS_PER_ROW, Alignment, Call, Mask, Operands, Options, SoftmaxType
from maxattn._src.cp import spec as cp_spec

IMPLEMENTATIONS = backends.names()
SUPPORTED_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_ALIGNMENTS = tuple(a.value for a in Alignment)
_SOFTMAX_TYPES = tuple(t.value for t in SoftmaxType)


class Canonical(NamedTuple):
    call: Call
    cp: Optional[cp_spec.ContextParallel]
    unbatched: bool  # the public inputs had no batch axis


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


def static_float(x: Any, name: str) -> float:
    """A Python float from a Python number or a concrete JAX/NumPy scalar.

    The fused kernels compile scalars like the scale in, so a traced value
    (e.g. a `jit` argument) is refused with a message saying what to do."""
    if isinstance(x, bool) or not (isinstance(x, (int, float, np.integer, np.floating)) or hasattr(x, "shape")):
        raise TypeError(f"`{name}` must be a Python float or a scalar array, got {type(x).__name__}")
    if hasattr(x, "shape") and tuple(x.shape) != ():
        raise ValueError(f"`{name}` must be a scalar, got shape {tuple(x.shape)}")
    if isinstance(x, jax.core.Tracer):
        raise TypeError(f"`{name}` is a traced JAX value (e.g. an argument of a jitted function); maxattn "
                        "compiles it into the kernels, so it must be known at trace time: pass a Python float "
                        f"or a concrete array, or make it static (jax.jit(..., static_argnames={name!r}))")
    if hasattr(x, "dtype") and not (jnp.issubdtype(x.dtype, jnp.floating) or jnp.issubdtype(x.dtype, jnp.integer)):
        raise TypeError(f"`{name}` must be a real number, got dtype {x.dtype}")
    return float(x)


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


def check_implementation(implementation: Any) -> None:
    if implementation is not None and implementation not in IMPLEMENTATIONS:
        raise ValueError(f"`implementation` must be None or one of {IMPLEMENTATIONS}, got {implementation!r}")


def _dropout(dropout_rate: Any, dropout_rng: Any) -> tuple[float, Optional[jax.Array]]:
    """Validates the dropout arguments; returns (rate, uint32 [4] seed or None)."""
    rate = static_float(dropout_rate, "dropout_rate")
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
    if softmax_type not in _SOFTMAX_TYPES:
        raise ValueError(f"`softmax_type` must be one of {_SOFTMAX_TYPES}, got {softmax_type!r}")
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


def _max_segments(value: Any, has_segment_ids: bool) -> int:
    """The static `max_segments_per_row` bound: 0 when not given."""
    if value is None:
        return 0
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"`max_segments_per_row` must be a Python int (a static bound), got "
                        f"{type(value).__name__}")
    if not 1 <= int(value) <= MAX_SEGMENTS_PER_ROW:
        raise ValueError(f"`max_segments_per_row` must be in [1, {MAX_SEGMENTS_PER_ROW}], got {value}")
    if not has_segment_ids:
        raise ValueError("`max_segments_per_row` needs `q_segment_ids` and `kv_segment_ids`")
    return int(value)


def canonicalize(query: Any, key: Any, value: Any, bias: Any = None, mask: Any = None, *,
                 scale: Optional[float] = None, is_causal: bool = False,
                 causal_alignment: str = "top_left", query_seq_lengths: Any = None,
                 key_value_seq_lengths: Any = None, q_segment_ids: Any = None,
                 kv_segment_ids: Any = None, max_segments_per_row: Any = None,
                 local_window_size: Any = None,
                 logits_soft_cap: Optional[float] = None, dropout_rate: Any = 0.0,
                 dropout_rng: Any = None, softmax_type: Any = "vanilla",
                 sink_logits: Any = None, return_max_logit: Any = False, return_lse: Any = False,
                 context_parallel: Any = None, context_parallel_axis: Any = None,
                 load_balanced: Any = False, deterministic_backward: Any = False) -> "Canonical":
    """Validates the public arguments; returns the call record, the context parallelism
    (None when not requested; its support for this call is checked here too) and whether
    the inputs were unbatched ([T, N, H]: the record then has a batch of one)."""
    q = _as_array(query, "query")
    k = _as_array(key, "key")
    v = _as_array(value, "value")
    if q.ndim not in (3, 4):
        raise ValueError(f"`query` must have rank 4 ([B, T, N, H]) or 3 ([T, N, H], no batch axis), got shape "
                         f"{q.shape}")
    unbatched = q.ndim == 3
    for name, x in (("key", k), ("value", v)):
        if x.ndim != q.ndim:
            layout = "[S, K, H]" if unbatched else "[B, S, K, H]"
            raise ValueError(f"`{name}` must have the rank of `query` ({q.ndim}: {layout}), got shape {x.shape}")
    if unbatched:  # jax.nn's unbatched form: a batch of one
        q, k, v = q[None], k[None], v[None]
        query_seq_lengths, key_value_seq_lengths = (
            None if x is None else jnp.reshape(_as_array(x, n), (-1,)) if np.ndim(x) == 0 else x
            for x, n in ((query_seq_lengths, "query_seq_lengths"), (key_value_seq_lengths, "key_value_seq_lengths")))
        q_segment_ids, kv_segment_ids = (
            None if x is None else (_as_array(x, n)[None] if np.ndim(x) == 1 else x)
            for x, n in ((q_segment_ids, "q_segment_ids"), (kv_segment_ids, "kv_segment_ids")))
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
    max_segments = _max_segments(max_segments_per_row, qseg is not None)

    if scale is None:
        scale_value = 1.0 / math.sqrt(H) if H > 0 else 1.0
    else:
        scale_value = static_float(scale, "scale")
        if not math.isfinite(scale_value):
            raise ValueError(f"`scale` must be finite, got {scale_value}")
    causal = _check_bool(is_causal, "is_causal")
    if causal_alignment not in _ALIGNMENTS:
        raise ValueError(f"`causal_alignment` must be one of {_ALIGNMENTS}, got {causal_alignment!r}")
    left, right = _window(local_window_size)
    # A bound of T + S or more removes nothing (whatever the alignment): clamp, so that
    # any int is accepted and fits the kernels' int64.
    left, right = (min(w, T + S) for w in (left, right))
    cap = 0.0
    if logits_soft_cap is not None:
        cap = static_float(logits_soft_cap, "logits_soft_cap")
        if not (cap > 0 and math.isfinite(cap)):
            raise ValueError(f"`logits_soft_cap` must be a finite float > 0, got {logits_soft_cap}")

    rate, seed = _dropout(dropout_rate, dropout_rng)
    sink = _softmax_type(softmax_type, sink_logits, N)

    options = Options(
        scale=scale_value,
        mask=Mask(causal=causal, alignment=Alignment(causal_alignment), window_left=left, window_right=right),
        softcap=cap, dropout_rate=rate, softmax=SoftmaxType(softmax_type),
        lse=_check_bool(return_lse, "return_lse"), max_logit=_check_bool(return_max_logit, "return_max_logit"),
        max_logit_over_batch=bool(return_max_logit),
        max_segments=max_segments,
        deterministic=_check_bool(deterministic_backward, "deterministic_backward"))
    call = Call(options, Operands(q, k, v, b, m, qlen, kvlen, qseg, kvseg, sink, seed))
    cp = cp_spec.make_spec(context_parallel, context_parallel_axis, load_balanced)
    if cp is not None:
        cp_spec.check_supported(cp, call)
    return Canonical(call, cp, unbatched)

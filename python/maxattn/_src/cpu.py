"""The "cpu" backend: the C++ tiled flash-attention kernels through XLA FFI."""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp

from maxattn._src import backends, batching
from maxattn._src.config import SUPPORTED_DTYPES, AttentionConfig, Operands

try:
    from maxattn import _maxattn_cpu  # type: ignore[attr-defined]
except ImportError as e:  # pragma: no cover - only when the extension was not built
    _maxattn_cpu = None
    _IMPORT_ERROR: Optional[str] = f"the CPU extension module could not be imported ({e})"
else:
    _IMPORT_ERROR = None

FWD_TARGET = "maxattn_attention_fwd_cpu"
BWD_TARGET = "maxattn_attention_bwd_cpu"


@functools.cache
def _register() -> None:
    for name, capsule in _maxattn_cpu.registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform="cpu")


def unsupported_reason(config: AttentionConfig, ops: Operands) -> Optional[str]:
    """Why the CPU backend cannot run this call, or None if it can."""
    del config
    if _IMPORT_ERROR is not None:
        return _IMPORT_ERROR
    if ops.query.dtype not in SUPPORTED_DTYPES:
        return f"the cpu backend supports float32, bfloat16 and float16 inputs, got {ops.query.dtype}"
    return None


def _placeholder(dtype) -> jax.Array:
    return jnp.zeros((0,), dtype)


def _operand_list(ops: Operands) -> list[jax.Array]:
    """The eleven operands of every FFI target (csrc/ffi/decode.h); placeholders
    for absent ones."""
    def opt(x, dtype):
        return _placeholder(dtype) if x is None else x
    return [
        ops.query, ops.key, ops.value,
        _placeholder(jnp.float32) if ops.bias is None else ops.bias.astype(jnp.float32),
        opt(ops.mask, jnp.bool_),
        opt(ops.q_seq_lengths, jnp.int32), opt(ops.kv_seq_lengths, jnp.int32),
        opt(ops.q_segment_ids, jnp.int32), opt(ops.kv_segment_ids, jnp.int32),
        _placeholder(jnp.float32) if ops.sink_logits is None else ops.sink_logits.astype(jnp.float32),
        opt(ops.dropout_seed, jnp.uint32),
    ]


def _forward_unbatched(config: AttentionConfig, want_lse: bool, want_max: bool, *arrays):
    ops = Operands(*arrays)
    _register()
    shapes = backends.forward_result_types(ops, want_lse, want_max)
    out, lse, mx = jax.ffi.ffi_call(FWD_TARGET, shapes)(*_operand_list(ops), **config.ffi_attributes())
    return out, (lse if want_lse else None), (mx if want_max else None)


def _backward_unbatched(config: AttentionConfig, *arrays):
    ops = Operands(*arrays[:11])
    out, lse, dout, dlse = arrays[11:]
    _register()
    q, k, v = ops.query, ops.key, ops.value
    f32 = jnp.float32
    shapes = (
        jax.ShapeDtypeStruct(q.shape, q.dtype),
        jax.ShapeDtypeStruct(k.shape, k.dtype),
        jax.ShapeDtypeStruct(v.shape, v.dtype),
        jax.ShapeDtypeStruct(ops.bias.shape if ops.bias is not None else (0,), f32),
        jax.ShapeDtypeStruct((q.shape[0], q.shape[2]) if ops.sink_logits is not None else (0,), f32),
    )
    dq, dk, dv, dbias, dsink = jax.ffi.ffi_call(BWD_TARGET, shapes)(
        *_operand_list(ops), out, dout, lse, _placeholder(f32) if dlse is None else dlse.astype(f32),
        **config.ffi_attributes())
    return (dq, dk, dv, (dbias if ops.bias is not None else None),
            (dsink if ops.sink_logits is not None else None))


_ROLES = (batching.BATCH,) * 3 + (batching.BCAST,) * 2 + (batching.BATCH,) * 4 + (batching.REPL,) * 2


@functools.cache
def _forward_fn(config: AttentionConfig, want_lse: bool, want_max: bool):
    return batching.fold_into_batch(
        functools.partial(_forward_unbatched, config, want_lse, want_max), _ROLES, (None, None, None))


@functools.cache
def _backward_fn(config: AttentionConfig):
    return batching.fold_into_batch(
        functools.partial(_backward_unbatched, config), _ROLES + (batching.BATCH,) * 4, (None, None, None, 3, None))


def forward(config: AttentionConfig, ops: Operands, want_lse: bool, want_max: bool):
    """(out, lse [B,N,T] f32 or None, max_logit [B,N] f32 or None)."""
    return _forward_fn(config, want_lse, want_max)(*ops)


def backward(config: AttentionConfig, ops: Operands, out, lse, dout, dlse):
    """(dq, dk, dv, dbias f32 like ops.bias or None), plus, only when ops has
    sink_logits, dsink f32 [B, N]: the sink-logit gradient per batch row (the
    caller sums it over axis 0). Backends without sink support return 4-tuples.
    """
    res = tuple(_backward_fn(config)(*ops, out, lse, dout, dlse))
    return res if ops.sink_logits is not None else res[:4]

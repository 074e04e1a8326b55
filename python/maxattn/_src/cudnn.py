"""The "cudnn" backend: cuDNN fused SDPA (cudnn-frontend graphs) through XLA FFI.

The C++ side (csrc/maxattn/cudnn/, csrc/ffi/cuda_handlers.cc) requests the
softmax row maxima from inside the fused kernel and reduces them to
max_logit[B, N] on the GPU; with cuDNN < 9.21 it asks for {Max, Sum_exp}
and forms lse = Max + log(Sum_exp) in a small kernel. A call that needs
neither lse nor max_logit runs the plain graph.

Arranged here before the FFI call:
  * bias in the input dtype, broadcast to [b', n', T, S] (cuDNN broadcasts
    only over batch and heads); dbias comes back in the input dtype and is
    summed over the axes we broadcast;
  * a dense boolean mask and segment ids are folded into that bias (entries
    they remove get the dtype's lowest finite value; the C++ side finds rows
    left with no key from the softmax statistics). This costs a [b', n', T, S]
    bias in memory and bandwidth, unlike the CPU backend;
  * q/kv sequence lengths given together (a missing one is the full length);
  * a non-zero lse cotangent: cuDNN's backward has no input for it, so it is
    folded into an extra value column: with o' = [o, -dlse], do' = [do, 1] and
    v' = [v, 0], cuDNN's D = rowsum(do' * o') becomes rowsum(do * o) - dlse,
    which is exactly the lse term of the softmax gradient.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp

from maxattn._src import backends, batching, reference
from maxattn._src.config import AttentionConfig, Operands

FWD_TARGET = "maxattn_attention_fwd_cuda"
BWD_TARGET = "maxattn_attention_bwd_cuda"
_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
_MAX_HEAD_DIM = 256
_DLSE_COLUMNS = 8  # cuDNN head dims are multiples of 8


@functools.cache
def _has_gpu() -> bool:
    try:
        return len(jax.devices("gpu")) > 0
    except RuntimeError:
        return False


@functools.cache
def _module():
    """(module, None) or (None, reason). Imported only once JAX's GPU backend
    is up, so that libcudnn.so.9 is already loaded by the CUDA plugin."""
    if not _has_gpu():
        return None, "JAX has no GPU backend (the cudnn backend needs a CUDA GPU)"
    try:
        from maxattn import _maxattn_cuda  # type: ignore[attr-defined]
    except ImportError as e:
        return None, f"the CUDA extension module could not be imported ({e}); build with MAXATTN_CUDA=ON"
    for name, capsule in _maxattn_cuda.registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform="CUDA")
    return _maxattn_cuda, None


def cudnn_version() -> Optional[int]:
    """The loaded cuDNN version (e.g. 91900), or None without the module."""
    module, _ = _module()
    return None if module is None else int(module.cudnn_version())


def _right_bound(config: AttentionConfig) -> Optional[int]:
    r = 0 if config.is_causal else None
    if config.window_right >= 0:
        r = config.window_right if r is None else min(r, config.window_right)
    return r


def unsupported_reason(config: AttentionConfig, ops: Operands) -> Optional[str]:
    """Why cuDNN cannot run this call, or None if it can."""
    _, reason = _module()
    if reason is not None:
        return reason
    q, k, v = ops.query, ops.key, ops.value
    if q.dtype not in _DTYPES:
        return f"dtype {q.dtype} unsupported: the cudnn backend runs bfloat16 and float16 inputs"
    masked = (config.is_causal or config.window_left >= 0 or config.window_right >= 0 or config.has_mask
              or config.has_q_seq_lengths or config.has_kv_seq_lengths or config.has_segment_ids)
    if config.softcap:
        if masked:
            return ("logits_soft_cap together with masking (causal, window, sequence lengths, segment ids or "
                    "mask) is a known cuDNN gap: cuDNN's score modifier disables its built-in masks")
        return "logits_soft_cap is not supported by the cudnn backend"
    B, T, N, H = q.shape
    S, Hv = k.shape[1], v.shape[3]
    for name, d in (("H", H), ("Hv", Hv)):
        if d % 8 or d > _MAX_HEAD_DIM or d == 0:
            return f"head dim {name}={d} unsupported: cuDNN needs a multiple of 8 between 8 and {_MAX_HEAD_DIM}"
    if B == 0 or T == 0 or S == 0 or N == 0:
        return "an empty batch, sequence or head axis is not supported by the cudnn backend"
    padding = config.has_q_seq_lengths or config.has_kv_seq_lengths
    right = _right_bound(config)
    banded = right is not None or config.window_left >= 0
    if banded and config.bottom_right:
        if padding and (config.has_bias or config.has_mask or config.has_segment_ids or config.has_dropout):
            return ("cuDNN does not support a bias, mask, segment ids or dropout together with bottom-right "
                    "alignment and sequence lengths")
        if not padding and right is not None and right + S - T < 0:
            return (f"bottom-right causal alignment with T={T} > S={S} leaves the first rows empty, which cuDNN "
                    "cannot express without sequence lengths")
    if config.window_left >= 0 and not padding and T > S:
        return f"cuDNN supports a sliding window only with T <= S (got T={T}, S={S})"
    return None


def _bias_with_masks(ops: Operands) -> Optional[jax.Array]:
    """The bias cuDNN sees: the user's bias (input dtype) with the dense mask and
    segment ids folded in, broadcast to [b', n', T, S]; None without any of them."""
    q = ops.query
    B, T, N, _ = q.shape
    S = ops.key.shape[1]
    bias = ops.bias
    if bias is not None:
        bias = bias.astype(q.dtype)
    keep = ops.mask
    if ops.q_segment_ids is not None:
        seg = reference.same_segment(ops.q_segment_ids, ops.kv_segment_ids)
        keep = seg if keep is None else keep & seg
    if keep is not None:
        lowest = jnp.asarray(jnp.finfo(q.dtype).min, q.dtype)
        bias = jnp.where(keep, jnp.zeros((), q.dtype) if bias is None else bias, lowest)
    if bias is None:
        return None
    return jnp.broadcast_to(bias, bias.shape[:2] + (T, S))


def _prepare(config: AttentionConfig, ops: Operands):
    """The eleven FFI operands and the attributes, in cuDNN's conventions."""
    q = ops.query
    B, T, N, _ = q.shape
    S = ops.key.shape[1]
    bias = _bias_with_masks(ops)
    qlen, kvlen = ops.q_seq_lengths, ops.kv_seq_lengths
    if (qlen is None) != (kvlen is None):
        qlen = jnp.full((B,), T, jnp.int32) if qlen is None else qlen
        kvlen = jnp.full((B,), S, jnp.int32) if kvlen is None else kvlen
    attrs = config.ffi_attributes()
    attrs.update(has_bias=bias is not None, has_q_seq_lengths=qlen is not None,
                 has_kv_seq_lengths=kvlen is not None)

    def opt(x, dtype):
        return jnp.zeros((0,), dtype) if x is None else x

    arrays = [q, ops.key, ops.value, opt(bias, q.dtype), opt(ops.mask, jnp.bool_),
              opt(qlen, jnp.int32), opt(kvlen, jnp.int32), opt(ops.q_segment_ids, jnp.int32),
              opt(ops.kv_segment_ids, jnp.int32),
              opt(None if ops.sink_logits is None else ops.sink_logits.astype(jnp.float32), jnp.float32),
              opt(ops.dropout_seed, jnp.uint32)]
    return arrays, attrs, bias


def _forward_unbatched(config: AttentionConfig, want_lse: bool, want_max: bool, *arrays):
    ops = Operands(*arrays)
    _module()
    shapes = backends.forward_result_types(ops, want_lse, want_max)
    operands, attrs, _ = _prepare(config, ops)
    out, lse, mx = jax.ffi.ffi_call(FWD_TARGET, shapes)(*operands, **attrs)
    return out, (lse if want_lse else None), (mx if want_max else None)


_NUM_OPERANDS = len(Operands._fields)


def _backward_unbatched(config: AttentionConfig, *arrays):
    ops = Operands(*arrays[:_NUM_OPERANDS])
    out, lse, dout, dlse = arrays[_NUM_OPERANDS:]
    _module()
    q, k, v = ops.query, ops.key, ops.value
    dtype = q.dtype
    Hv = v.shape[3]
    if dlse is not None:
        # Fold the lse cotangent into an extra value column (see the module docstring).
        B, T, N, _ = q.shape
        col = -jnp.transpose(dlse.astype(jnp.float32), (0, 2, 1))[..., None]  # [B, T, N, 1]
        pad_o = jnp.concatenate([col, jnp.zeros((B, T, N, _DLSE_COLUMNS - 1), jnp.float32)], -1).astype(dtype)
        pad_do = jnp.zeros((B, T, N, _DLSE_COLUMNS), dtype).at[..., 0].set(1)
        out = jnp.concatenate([out, pad_o], -1)
        dout = jnp.concatenate([dout.astype(dtype), pad_do], -1)
        v = jnp.concatenate([v, jnp.zeros(v.shape[:3] + (_DLSE_COLUMNS,), dtype)], -1)
        ops = ops._replace(value=v)
    operands, attrs, bias = _prepare(config, ops)
    want_dbias = ops.bias is not None
    has_sink = ops.sink_logits is not None
    shapes = (
        jax.ShapeDtypeStruct(q.shape, dtype),
        jax.ShapeDtypeStruct(k.shape, dtype),
        jax.ShapeDtypeStruct(v.shape, dtype),
        jax.ShapeDtypeStruct(bias.shape if want_dbias else (0,), dtype),
        jax.ShapeDtypeStruct((q.shape[0], q.shape[2]) if has_sink else (0,), jnp.float32),
    )
    dq, dk, dv, dbias, dsink = jax.ffi.ffi_call(BWD_TARGET, shapes)(
        *operands, out, dout.astype(dtype), lse, jnp.zeros((0,), jnp.float32), **attrs)
    dv = dv[..., :Hv]
    if want_dbias:
        # cuDNN's dbias has the folded bias's shape; sum it over the axes the user's bias broadcasts.
        axes = tuple(a for a in range(4) if ops.bias.shape[a] == 1 and dbias.shape[a] != 1)
        dbias = dbias.astype(jnp.float32)
        if axes:
            dbias = jnp.sum(dbias, axis=axes, keepdims=True)
    else:
        dbias = None
    return dq, dk, dv, dbias, (dsink if has_sink else None)


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
    """(dq, dk, dv, dbias float32 like ops.bias or None), plus dsink f32 [B, N]
    when ops has sink_logits (as the CPU backend's `backward`)."""
    res = tuple(_backward_fn(config)(*ops, out, lse, dout, dlse))
    return res if ops.sink_logits is not None else res[:4]

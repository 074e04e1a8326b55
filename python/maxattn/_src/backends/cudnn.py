"""The "cudnn" backend: cuDNN fused SDPA (cudnn-frontend graphs) through XLA FFI.

The C++ side (csrc/maxattn/cudnn/, csrc/ffi/cuda_handlers.cc) requests the
softmax row maxima from inside the fused kernel and reduces them to
max_logit[B, N] on the GPU; with cuDNN < 9.21 it asks for {Max, Sum_exp}
and forms lse = Max + log(Sum_exp) in a small kernel. A call that needs
neither lse nor max_logit runs the plain graph. Whether cuDNN can run a call
is decided by the C++ planner (`cudnn::CheckSupported`), which this module
asks through the extension, so the refusal reason and the kernel agree.

Arranged here before the FFI call (`_as_cudnn_sees_it`):
  * bias in the input dtype, broadcast to [b', n', T, S] (cuDNN broadcasts
    only over batch and heads); dbias comes back in the input dtype and is
    summed over the axes we broadcast;
  * a dense boolean mask and segment ids are folded into that bias (entries
    they remove get the dtype's lowest finite value; the C++ side finds rows
    left with no key from the softmax statistics). This costs a [b', n', T, S]
    bias in memory and bandwidth, unlike the CPU backend;
  * except segment ids with `max_segments_per_row` (Options.max_segments) and
    no bias, mask, dropout or sink: the C++ side turns them into cuDNN ragged
    sequences on the device (csrc/maxattn/cudnn/ragged.h), O(B * T). With any
    of those four the bound is dropped here (`_effective`) and the dense bias
    is used, with a one-time warning;
  * q/kv sequence lengths given together (a missing one is the full length);
  * a non-zero lse cotangent: cuDNN's backward has no input for it, so it is
    folded into an extra value column: with o' = [o, -dlse], do' = [do, 1] and
    v' = [v, 0], cuDNN's D = rowsum(do' * o') becomes rowsum(do * o) - dlse,
    which is exactly the lse term of the softmax gradient. Where the widened
    value head dim is past cuDNN's limit (Hv > 248), the lse term is a second
    backward call of its own instead, with those columns as its only value
    columns (o'' = [-dlse, 0], do'' = [1, 0], v'' = 0, so dP'' = 0 and dS'' =
    P * dlse); its dq, dk, dbias and dsink add to the first call's. It costs
    the score-side GEMMs a second time.
"""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp

from maxattn._src import reference
from maxattn._src.backends import ffi
from maxattn._src.call import Call, Fwd, Grads, Saved
from maxattn._src.warn import warn_once

FWD_TARGET = "maxattn_attention_fwd_cuda"
BWD_TARGET = "maxattn_attention_bwd_cuda"
_DLSE_COLUMNS = 8  # cuDNN head dims are multiples of 8


@functools.cache
def _has_gpu() -> bool:
    try:
        return len(jax.devices("gpu")) > 0
    except RuntimeError:
        return False


@functools.cache
def module():
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
    mod, _ = module()
    return None if mod is None else int(mod.cudnn_version())


def _folded_bias(call: Call) -> Optional[jax.Array]:
    """The bias cuDNN sees: the user's bias (input dtype) with the dense mask and
    segment ids folded in, broadcast to [b', n', T, S]; None without any of them."""
    ops = call.operands
    q = ops.query
    bias = None if ops.bias is None else ops.bias.astype(q.dtype)
    keep = ops.mask
    if call.dense_segments:
        seg = reference.same_segment(ops.q_segment_ids, ops.kv_segment_ids)
        keep = seg if keep is None else keep & seg
    if keep is not None:
        lowest = jnp.asarray(jnp.finfo(q.dtype).min, q.dtype)
        bias = jnp.where(keep, jnp.zeros((), q.dtype) if bias is None else bias, lowest)
    if bias is None:
        return None
    return jnp.broadcast_to(bias, bias.shape[:2] + (call.q_len, call.kv_len))


def _ragged_blocker(call: Call) -> Optional[str]:
    """Why a call with max_segments cannot take the ragged path, or None."""
    ops = call.operands
    for present, what in ((ops.bias is not None, "a bias"), (ops.mask is not None, "a mask"),
                          (call.options.dropout_rate > 0, "dropout"), (ops.sink_logits is not None, "sinks")):
        if present:
            return what
    return None


def _effective(call: Call, warn: bool = False) -> Call:
    """The call as this backend runs it: max_segments dropped where the ragged
    path cannot take it. With `warn`, says once what the dense path costs."""
    seg = call.operands.q_segment_ids is not None
    if seg and call.options.max_segments > 0:
        blocker = _ragged_blocker(call)
        if blocker is None:
            return call
        if warn:
            warn_once(f"maxattn cudnn: max_segments_per_row is ignored with {blocker}; segment ids are folded "
                      f"into a dense [B, 1, T, S] bias (O(T * S) memory and time)")
        return call.replace(options=call.options.replace(max_segments=0))
    if seg and warn:
        warn_once("maxattn cudnn: segment ids without max_segments_per_row are folded into a dense [B, 1, T, S] "
                  "bias (O(T * S) memory and time); pass max_segments_per_row=M (a bound on the segments per "
                  "row) to run them as cuDNN ragged sequences")
    return call


def _as_cudnn_sees_it(call: Call) -> Call:
    """The call in cuDNN's conventions (see the module docstring). Mask and segment
    ids stay as operands: their presence tells the C++ side a row may lose every key."""
    ops = call.operands
    qlen, kvlen = ops.q_seq_lengths, ops.kv_seq_lengths
    if (qlen is None) != (kvlen is None):
        qlen = jnp.full((call.batch,), call.q_len, jnp.int32) if qlen is None else qlen
        kvlen = jnp.full((call.batch,), call.kv_len, jnp.int32) if kvlen is None else kvlen
    sink = None if ops.sink_logits is None else ops.sink_logits.astype(jnp.float32)
    return call.replace(bias=_folded_bias(call), q_seq_lengths=qlen, kv_seq_lengths=kvlen, sink_logits=sink)


def lse_columns(dlse: jax.Array, q_shape: tuple, v_shape: tuple, dtype) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The lse cotangent dlse [B, N, T] as _DLSE_COLUMNS value columns (module docstring):
    (o'' = [-dlse, 0...] [B, T, N, 8], do'' = [1, 0...] [B, T, N, 8], v'' = 0 [B, S, K, 8]).
    Appended to out, dout and value they fold the lse term into one backward; alone, as a
    backward of their own, they give exactly the lse term's dq, dk, dbias and dsink."""
    B, T, N, _ = q_shape
    ct = jnp.promote_types(dlse.dtype, jnp.float32)
    col = -jnp.transpose(dlse.astype(ct), (0, 2, 1))[..., None]  # [B, T, N, 1]
    pad_o = jnp.concatenate([col, jnp.zeros((B, T, N, _DLSE_COLUMNS - 1), ct)], -1).astype(dtype)
    pad_do = jnp.zeros((B, T, N, _DLSE_COLUMNS), dtype).at[..., 0].set(1)
    pad_v = jnp.zeros(tuple(v_shape[:3]) + (_DLSE_COLUMNS,), dtype)
    return pad_o, pad_do, pad_v


class CudnnBackend:
    name = "cudnn"

    def unsupported_reason(self, call: Call) -> Optional[str]:
        mod, reason = module()
        if reason is not None:
            return reason
        call = _effective(call)
        ops = call.operands
        # Folded into the bias: a mask, and segment ids off the ragged path.
        masked = ops.mask is not None or call.dense_segments
        attrs = {k: v.item() if hasattr(v, "item") else v for k, v in call.options.ffi_attributes().items()}
        return mod.unsupported_reason(
            (call.batch, call.q_len, call.kv_len, call.num_heads, call.num_kv_heads, ops.query.shape[3],
             ops.value.shape[3]), str(ops.query.dtype), **attrs,
            bias=ops.bias is not None or masked, masked_by_bias=masked,
            padding=ops.q_seq_lengths is not None or ops.kv_seq_lengths is not None,
            sink=ops.sink_logits is not None)

    def forward(self, call: Call) -> Fwd:
        module()
        call = _effective(call, warn=True)
        return ffi.forward(FWD_TARGET, call, _as_cudnn_sees_it(call).operands)

    def backward(self, call: Call, saved: Saved) -> Grads:
        module()
        call = _effective(call)
        ops = call.operands
        q, v = ops.query, ops.value
        dtype, Hv = q.dtype, v.shape[3]
        out, dout = saved.out, saved.dout.astype(dtype)
        lse_term = None  # the lse cotangent's gradients from a call of their own
        if saved.dlse is not None:
            pad_o, pad_do, pad_v = lse_columns(saved.dlse, q.shape, v.shape, dtype)
            widened = call.replace(value=jnp.concatenate([v, pad_v], -1))
            if self.unsupported_reason(widened) is None:
                out = jnp.concatenate([out, pad_o], -1)
                dout = jnp.concatenate([dout, pad_do], -1)
                call = widened
            else:
                alone = call.replace(value=pad_v)
                lse_term = ffi.backward(BWD_TARGET, alone, _as_cudnn_sees_it(alone).operands,
                                        Saved(pad_o, saved.lse, pad_do, None), dtype)
        g = ffi.backward(BWD_TARGET, call, _as_cudnn_sees_it(call).operands, Saved(out, saved.lse, dout, None),
                         dtype)
        dq, dk, dv, dbias, dsink = g.dq, g.dk, g.dv, g.dbias, g.dsink
        dv = dv[..., :Hv]
        if lse_term is not None:
            def add(a, b):  # in float32; dbias and dsink stay there (their result dtype)
                return a.astype(jnp.float32) + b.astype(jnp.float32)
            dq, dk = add(dq, lse_term.dq).astype(dq.dtype), add(dk, lse_term.dk).astype(dk.dtype)
            dbias = None if dbias is None else add(dbias, lse_term.dbias)
            dsink = None if dsink is None else add(dsink, lse_term.dsink)
        if dbias is not None:
            # cuDNN's dbias has the folded bias's shape; sum it over the axes the user's bias broadcasts.
            axes = tuple(a for a in range(4) if ops.bias.shape[a] == 1 and dbias.shape[a] != 1)
            dbias = dbias.astype(jnp.float32)
            if axes:
                dbias = jnp.sum(dbias, axis=axes, keepdims=True)
        return Grads(dq, dk, dv, dbias, dsink)


BACKEND = CudnnBackend()

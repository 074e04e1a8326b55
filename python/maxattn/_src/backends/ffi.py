"""What the FFI backends share: the operand list and result types of every target.

Every FFI target (csrc/ffi/handler.h) takes the same eleven operands in the
order of `Operands` -- an absent optional operand is the placeholder [0] --
and the attributes of `Options.ffi_attributes()`. An unrequested optional
result is the placeholder [0] too: the buffers say what is present.
"""

from __future__ import annotations

from typing import Optional

import jax
import jax.numpy as jnp

from maxattn._src.call import Call, Fwd, Grads, Operands, Saved

_PLACEHOLDER_DTYPES = dict(
    bias=jnp.float32, mask=jnp.bool_, q_seq_lengths=jnp.int32, kv_seq_lengths=jnp.int32,
    q_segment_ids=jnp.int32, kv_segment_ids=jnp.int32, sink_logits=jnp.float32, dropout_seed=jnp.uint32)


def placeholder(dtype) -> jax.Array:
    return jnp.zeros((0,), dtype)


def operand_list(ops: Operands) -> list[jax.Array]:
    """The eleven operands, placeholders for the absent ones."""
    return [placeholder(_PLACEHOLDER_DTYPES[name]) if x is None else x for name, x in zip(ops._fields, ops)]


def _result(shape, dtype, present: bool = True) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(shape if present else (0,), dtype)


def forward_result_types(call: Call, max_logit_over_batch: bool = False) -> tuple:
    """out [B, T, N, Hv] in the input dtype, lse [B, N, T] f32, max_logit [B, N] f32 ([1, N], the max
    over the batch rows, with `max_logit_over_batch`: only targets that reduce in their kernel)."""
    q, v = call.operands.query, call.operands.value
    B, T, N, _ = q.shape
    return (_result((B, T, N, v.shape[3]), q.dtype), _result((B, N, T), jnp.float32, call.options.lse),
            _result((1 if max_logit_over_batch else B, N), jnp.float32, call.options.max_logit))


def backward_result_types(call: Call, dbias_shape: Optional[tuple], dbias_dtype) -> tuple:
    """dq, dk, dv like q, k, v; dbias of `dbias_shape` ([0] without); dsink [B, N] f32 ([0] without)."""
    ops = call.operands
    q, k, v = ops.query, ops.key, ops.value
    return (_result(q.shape, q.dtype), _result(k.shape, k.dtype), _result(v.shape, v.dtype),
            _result(dbias_shape, dbias_dtype, dbias_shape is not None),
            _result((q.shape[0], q.shape[2]), jnp.float32, ops.sink_logits is not None))


def _saved_list(saved: Saved) -> list[jax.Array]:
    """out, dout, lse, dlse (placeholder when zero): the backward's operands after the eleven."""
    dlse = placeholder(jnp.float32) if saved.dlse is None else saved.dlse.astype(jnp.float32)
    return [saved.out, saved.dout, saved.lse, dlse]


def forward(target: str, call: Call, operands: Operands, max_logit_over_batch: bool = False) -> Fwd:
    """Runs forward target `target` on `operands` (the call's, in the backend's conventions);
    `max_logit_over_batch`: the target reduces max_logit over the batch ([1, N])."""
    out, lse, mx = jax.ffi.ffi_call(target, forward_result_types(call, max_logit_over_batch))(
        *operand_list(operands), **call.options.ffi_attributes())
    return Fwd(out, lse if call.options.lse else None, mx if call.options.max_logit else None)


def backward(target: str, call: Call, operands: Operands, saved: Saved, dbias_dtype) -> Grads:
    """Runs backward target `target`; dbias (of the shape of operands.bias, in `dbias_dtype`)
    iff the call has a bias, dsink iff it has sink logits."""
    has_bias = call.operands.bias is not None
    dbias_shape = operands.bias.shape if has_bias else None
    dq, dk, dv, dbias, dsink = jax.ffi.ffi_call(target, backward_result_types(call, dbias_shape, dbias_dtype))(
        *operand_list(operands), *_saved_list(saved), **call.options.ffi_attributes())
    return Grads(dq, dk, dv, dbias if has_bias else None, dsink if call.operands.sink_logits is not None else None)

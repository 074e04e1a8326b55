"""The "sm90" backend: our own Hopper (sm_90a) kernels (csrc/maxattn/sm90/).

Warp-specialised TMA + WGMMA flash attention with max_logit reduced inside the
forward kernel (one atomic max per warp), the logit soft cap in its softmax,
segment ids without a dense bias (cross-document tiles skipped, ids compared
only in the tiles on a document boundary) and attention sinks in its
epilogue. They live in the CUDA extension module next to the cuDNN targets
(built when the CUTLASS headers are found at build time).

The backward runs on the forward's residuals (out and the lse in the
contract's natural-log [B, N, T] form) and is ours at head dims 64, 128 and
256 (same features as the forward, the sinks' gradient included; dQ is
summed by atomics, so it can differ in the last bits between runs unless
`deterministic_backward=True` makes the CTAs add in turn). Where our
backward refuses a call the forward runs (its reason comes from the C++
Sm90BackwardUnsupportedReason) it is cuDNN's, and the call must suit both
(the reason names whichever refuses), or, with a soft cap, which cuDNN
lacks, the pure-JAX one of xla.py. Our kernels are exact for any segment ids and ignore
`max_segments_per_row`; where the backward is cuDNN's that bound is
refused, because cuDNN's ragged backward would poison the rows that break
it while the sm90 forward is exact on them. `implementation=None` tries
sm90 first at head dims 128 and 256 and for segment ids, cuDNN first
otherwise (backends/__init__.py).
"""

from __future__ import annotations

import functools
from typing import Optional

import jax

from maxattn._src.backends import cudnn, ffi, xla
from maxattn._src.call import Call, Fwd, Grads, Saved

FWD_TARGET = "maxattn_attention_fwd_sm90"
BWD_TARGET = "maxattn_attention_bwd_sm90"


@functools.cache
def _compute_capability() -> Optional[str]:
    try:
        return str(getattr(jax.devices("gpu")[0], "compute_capability", None))
    except RuntimeError:
        return None


NOT_BUILT = ("the CUDA extension module was built without the sm90 kernels (no CUTLASS headers at build "
             "time: pip install nvidia-cutlass==4.2.0.0 and rebuild)")


def availability_reason() -> Optional[str]:
    """Why the sm90 kernels cannot run any call on this machine (no module, not built, not Hopper), or None."""
    mod, reason = cudnn.module()
    if reason is not None:
        return reason
    if not hasattr(mod, "sm90_unsupported_reason"):
        return NOT_BUILT
    cc = _compute_capability()
    if cc != "9.0":
        return f"the sm90 kernels need a compute capability 9.0 GPU (Hopper), found {cc}"
    return None


def _kernel_reason(call: Call, backward: bool) -> Optional[str]:
    """Why our forward (or backward) kernels cannot run `call`, or None."""
    reason = availability_reason()
    if reason is not None:
        return reason
    mod, _ = cudnn.module()
    ops = call.operands
    attrs = {k: v.item() if hasattr(v, "item") else v for k, v in call.options.ffi_attributes().items()}
    return mod.sm90_unsupported_reason(
        (call.batch, call.q_len, call.kv_len, call.num_heads, call.num_kv_heads, ops.query.shape[3],
         ops.value.shape[3]), str(ops.query.dtype), **attrs, bias=ops.bias is not None,
        mask=ops.mask is not None, padding=ops.q_seq_lengths is not None or ops.kv_seq_lengths is not None,
        segments=ops.q_segment_ids is not None, sink=ops.sink_logits is not None, backward=backward)


def _own_backward(call: Call) -> bool:
    """Whether our backward kernel runs this call's gradient."""
    return _kernel_reason(call, backward=True) is None


def _fallback_backward(call: Call):
    """Whose backward serves an sm90 forward that ours cannot: cuDNN's, or the pure-JAX one (xla.py) for a soft cap."""
    return xla.BACKEND if call.options.softcap else cudnn.BACKEND


class Sm90Backend:
    name = "sm90"

    def unsupported_reason(self, call: Call) -> Optional[str]:
        reason = _kernel_reason(call, backward=False)
        if reason is not None:
            return reason
        if _own_backward(call):
            return None
        if call.options.max_segments > 0:
            return ("max_segments_per_row is a promise for cuDNN's ragged path, which would run this call's "
                    "backward (the sm90 backward has no kernel for it) and turn the rows that break it into NaN "
                    "while the sm90 forward is exact on them; drop it (the sm90 kernels need no bound) or use "
                    "implementation=\"cudnn\"")
        backward = _fallback_backward(call).unsupported_reason(call)
        if backward is not None:
            return f"the sm90 backward has no kernel for it, its backward runs on cuDNN, and {backward}"
        return None

    def forward(self, call: Call) -> Fwd:
        cudnn.module()  # registers the targets
        # One atomic max per head instead of per (batch row, head) when the rows are wanted reduced.
        return ffi.forward(FWD_TARGET, call, call.operands, max_logit_over_batch=call.options.max_logit_over_batch)

    def backward(self, call: Call, saved: Saved) -> Grads:
        if _own_backward(call):
            # No bias is supported, so dbias never comes back; its dtype argument is unused.
            dtype = call.operands.query.dtype
            return ffi.backward(BWD_TARGET, call, call.operands, saved._replace(dout=saved.dout.astype(dtype)), dtype)
        return _fallback_backward(call).backward(call, saved)


BACKEND = Sm90Backend()

"""The "sm90" backend: our own Hopper (sm_90a) forward kernel (csrc/maxattn/sm90/).

Warp-specialised TMA + WGMMA flash attention with max_logit reduced inside the
kernel (one atomic max per warp), the logit soft cap in its softmax, segment
ids without a dense bias (cross-document tiles skipped, ids compared only in
the tiles on a document boundary) and attention sinks in its epilogue. It
lives in the CUDA extension module next to the cuDNN targets (built when the
CUTLASS headers are found at build time). Until the sm90 backward lands, the
backward runs on this forward's residuals (out and the lse in the contract's
natural-log [B, N, T] form): cuDNN's, so a call must suit both (the reason
names whichever refuses); with a soft cap, which cuDNN lacks, the reference's
(xla.py: exact, but it materialises the [B, N, T, S] logits). With segment ids
that backward is cuDNN's dense-bias form (O(T * S)); a `max_segments_per_row`
bound is refused here, because cuDNN's ragged backward would poison the rows
that break it while this forward is exact on them. `implementation=None`
tries sm90 after cuDNN (backends/__init__.py: where both run, the cuDNN forward
is as fast or faster on the H200; bench/RESULTS.md).
"""

from __future__ import annotations

import functools
from typing import Optional

import jax

from maxattn._src.backends import cudnn, ffi, xla
from maxattn._src.call import Call, Fwd, Grads, Saved

FWD_TARGET = "maxattn_attention_fwd_sm90"


@functools.cache
def _compute_capability() -> Optional[str]:
    try:
        return str(getattr(jax.devices("gpu")[0], "compute_capability", None))
    except RuntimeError:
        return None


class Sm90Backend:
    name = "sm90"

    def unsupported_reason(self, call: Call) -> Optional[str]:
        mod, reason = cudnn.module()
        if reason is not None:
            return reason
        if not hasattr(mod, "sm90_unsupported_reason"):
            return ("the CUDA extension module was built without the sm90 kernels (no CUTLASS headers at build "
                    "time: pip install nvidia-cutlass==4.2.0.0 and rebuild)")
        cc = _compute_capability()
        if cc != "9.0":
            return f"the sm90 kernels need a compute capability 9.0 GPU (Hopper), found {cc}"
        ops = call.operands
        attrs = {k: v.item() if hasattr(v, "item") else v for k, v in call.options.ffi_attributes().items()}
        reason = mod.sm90_unsupported_reason(
            (call.batch, call.q_len, call.kv_len, call.num_heads, call.num_kv_heads, ops.query.shape[3],
             ops.value.shape[3]), str(ops.query.dtype), **attrs, bias=ops.bias is not None,
            mask=ops.mask is not None, padding=ops.q_seq_lengths is not None or ops.kv_seq_lengths is not None,
            segments=ops.q_segment_ids is not None, sink=ops.sink_logits is not None)
        if reason is not None:
            return reason
        if call.options.max_segments > 0:
            return ("max_segments_per_row is a promise for cuDNN's ragged path, which would run this call's "
                    "backward and turn the rows that break it into NaN while the sm90 forward is exact on them; "
                    "drop it (the sm90 kernel needs no bound) or use implementation=\"cudnn\"")
        backward = _backward_backend(call).unsupported_reason(call)
        if backward is not None:
            return f"its backward runs on cuDNN until the sm90 backward lands, and {backward}"
        return None

    def forward(self, call: Call) -> Fwd:
        cudnn.module()  # registers the targets
        return ffi.forward(FWD_TARGET, call, call.operands)

    def backward(self, call: Call, saved: Saved) -> Grads:
        return _backward_backend(call).backward(call, saved)


def _backward_backend(call: Call):
    """Whose backward serves an sm90 forward: cuDNN's, or the reference's for a soft cap."""
    return xla.BACKEND if call.options.softcap else cudnn.BACKEND


BACKEND = Sm90Backend()

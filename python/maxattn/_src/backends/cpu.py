"""The "cpu" backend: the C++ tiled flash-attention kernels through XLA FFI."""

from __future__ import annotations

import functools
from typing import Optional

import jax
import jax.numpy as jnp

from maxattn._src.backends import ffi
from maxattn._src.call import Call, Fwd, Grads, Saved
from maxattn._src.canonicalize import SUPPORTED_DTYPES

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
def register() -> None:
    for name, capsule in _maxattn_cpu.registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform="cpu")


class CpuBackend:
    name = "cpu"

    def unsupported_reason(self, call: Call) -> Optional[str]:
        if _IMPORT_ERROR is not None:
            return _IMPORT_ERROR
        dtype = call.operands.query.dtype
        if dtype not in SUPPORTED_DTYPES:
            return f"the cpu backend supports float32, bfloat16 and float16 inputs, got {dtype}"
        return None

    def forward(self, call: Call) -> Fwd:
        register()
        return ffi.forward(FWD_TARGET, call, _f32_bias(call))

    def backward(self, call: Call, saved: Saved) -> Grads:
        register()
        return ffi.backward(BWD_TARGET, call, _f32_bias(call), saved, jnp.float32)


def _f32_bias(call: Call):
    """The CPU kernels read the bias (and sink logits) in float32."""
    ops = call.operands
    return ops._replace(bias=None if ops.bias is None else ops.bias.astype(jnp.float32),
                        sink_logits=None if ops.sink_logits is None else ops.sink_logits.astype(jnp.float32))


BACKEND = CpuBackend()

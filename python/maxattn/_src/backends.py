"""Registry of the fused backends and the platform's preferred one.

Each backend module provides `unsupported_reason(config, ops)`,
`forward(config, ops, want_lse, want_max)` and
`backward(config, ops, out, lse, dout, dlse)` with the conventions of
maxattn._src.cpu. Backend modules are imported lazily so that the CUDA one is
only imported when a GPU is present.
"""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import Optional

import jax
import jax.numpy as jnp

from maxattn._src.config import AttentionConfig, Operands

_MODULES = {"cpu": "maxattn._src.cpu", "cudnn": "maxattn._src.cudnn"}
_PREFERRED = {"cpu": "cpu", "gpu": "cudnn", "cuda": "cudnn"}


def get(name: str) -> ModuleType:
    return importlib.import_module(_MODULES[name])


def preferred_for_platform(platform: str) -> Optional[str]:
    """The fused backend used by implementation=None on `platform`, if any."""
    return _PREFERRED.get(platform)


def unsupported_reason(name: str, config: AttentionConfig, ops: Operands) -> Optional[str]:
    try:
        module = get(name)
    except ImportError as e:
        return f"the {name} backend is not available ({e})"
    return module.unsupported_reason(config, ops)


def forward_result_types(ops: Operands, want_lse: bool, want_max: bool) -> tuple:
    """Result types of every forward FFI target: out [B, T, N, Hv] in the input
    dtype, lse [B, N, T] f32 and max_logit [B, N] f32; an unrequested optional
    result is the placeholder [0]."""
    B, T, N, _ = ops.query.shape
    Hv = ops.value.shape[3]
    return (
        jax.ShapeDtypeStruct((B, T, N, Hv), ops.query.dtype),
        jax.ShapeDtypeStruct((B, N, T) if want_lse else (0,), jnp.float32),
        jax.ShapeDtypeStruct((B, N) if want_max else (0,), jnp.float32),
    )

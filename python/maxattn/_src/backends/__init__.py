"""Registry of the backends: adding one is a new module here plus one line in `_MODULES`.

Each module defines `BACKEND`, an object implementing `base.Backend`. Modules
are imported lazily, so that the CUDA one is only imported when it is asked for.
"""

from __future__ import annotations

import importlib
from typing import Optional

from maxattn._src.backends.base import Backend

_MODULES = {
    "xla": "maxattn._src.backends.xla",
    "cpu": "maxattn._src.backends.cpu",
    "cudnn": "maxattn._src.backends.cudnn",
    "sm90": "maxattn._src.backends.sm90",
}
# The fused backends `implementation=None` tries on each JAX platform, in order. On a GPU our own
# Hopper kernels come first: by device time they match cuDNN's forward and forward+backward at head
# dim 128, beat FlashAttention-3's forward at 64, reduce max_logit inside the kernel (cuDNN needs a
# second kernel) and run soft caps and segment ids without a dense bias (bench/RESULTS.md). cuDNN
# runs what sm90 refuses (a GPU other than Hopper, a bias or mask, dropout, unequal head dims), and
# both refusals are then part of the fallback warning.
_AUTO = {"cpu": ("cpu",), "gpu": ("sm90", "cudnn"), "cuda": ("sm90", "cudnn")}
# Head dims with another order: at 256 cuDNN's forward takes 0.88x the sm90 forward's time (H100,
# 2026-12-06), so cuDNN comes first there and sm90 runs what it refuses (a soft cap: Gemma-2).
_AUTO_BY_HEAD_DIM = {256: {"gpu": ("cudnn", "sm90"), "cuda": ("cudnn", "sm90")}}


def names() -> tuple[str, ...]:
    """Every `implementation=` name, registry order."""
    return tuple(_MODULES)


def get(name: str) -> Backend:
    return importlib.import_module(_MODULES[name]).BACKEND


def auto_order(platform: str, head_dim: Optional[int] = None) -> tuple[str, ...]:
    """The fused backends implementation=None tries on `platform` for a call of `head_dim`, in order
    (may be empty)."""
    return _AUTO_BY_HEAD_DIM.get(head_dim, {}).get(platform) or _AUTO.get(platform, ())


def unsupported_reason(name: str, call) -> Optional[str]:
    try:
        backend = get(name)
    except ImportError as e:
        return f"the {name} backend is not available ({e})"
    return backend.unsupported_reason(call)

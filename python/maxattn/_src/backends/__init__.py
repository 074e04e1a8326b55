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
# The fused backends `implementation=None` tries on each JAX platform, in order. cuDNN runs what
# sm90 refuses (a GPU other than Hopper, a bias or mask, dropout, unequal head dims) and sm90 what
# cuDNN refuses (a soft cap); both refusals are part of the fallback warning when neither runs.
_AUTO = {"cpu": ("cpu",), "gpu": ("cudnn", "sm90"), "cuda": ("cudnn", "sm90")}
# Where both run, our Hopper kernels come first at head dims 128 and 256. At 128 they match cuDNN's
# forward and forward+backward by device time and reduce max_logit inside the kernel (H100,
# 2026-12-06, bench/RESULTS.md). At 256 cuDNN's forward is ~3% faster (252 us against 260 at
# (4,2048,16,16,256) causal, about even once max_logit's second kernel is counted) but ours trains
# faster: forward+backward 1311 us against 1346 (H100, 2026-12-06, tenth session). At 64 cuDNN is
# faster both ways (187 us against 200 forward at (8,2048,16,16,64) causal). Segment ids go to sm90 at
# every head dim: cuDNN folds them into an O(T*S) dense bias (10x slower at T = 8192) unless
# max_segments_per_row promises its ragged layout.
_SM90_FIRST_HEAD_DIMS = (128, 256)


def names() -> tuple[str, ...]:
    """Every `implementation=` name, registry order."""
    return tuple(_MODULES)


def get(name: str) -> Backend:
    return importlib.import_module(_MODULES[name]).BACKEND


def auto_order(platform: str, head_dim: Optional[int] = None, dense_segments: bool = False) -> tuple[str, ...]:
    """The fused backends implementation=None tries on `platform`, in order (may be empty), for a call
    of `head_dim` with (`dense_segments`) or without segment ids that have no max_segments_per_row."""
    order = _AUTO.get(platform, ())
    if order[:2] == ("cudnn", "sm90") and (head_dim in _SM90_FIRST_HEAD_DIMS or dense_segments):
        return ("sm90", "cudnn") + order[2:]
    return order


def unsupported_reason(name: str, call) -> Optional[str]:
    try:
        backend = get(name)
    except ImportError as e:
        return f"the {name} backend is not available ({e})"
    return backend.unsupported_reason(call)

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

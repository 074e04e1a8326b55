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
# The fused backend `implementation=None` prefers on each JAX platform.
_PREFERRED = {"cpu": "cpu", "gpu": "cudnn", "cuda": "cudnn"}


def names() -> tuple[str, ...]:
    """Every `implementation=` name, registry order."""
    return tuple(_MODULES)


def get(name: str) -> Backend:
    return importlib.import_module(_MODULES[name]).BACKEND


def preferred_for_platform(platform: str) -> Optional[str]:
    """The fused backend used by implementation=None on `platform`, if any."""
    return _PREFERRED.get(platform)


def unsupported_reason(name: str, call) -> Optional[str]:
    try:
        backend = get(name)
    except ImportError as e:
        return f"the {name} backend is not available ({e})"
    return backend.unsupported_reason(call)

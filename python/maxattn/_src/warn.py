"""The package's one-time warnings (one owner for the "warn once" rule)."""

from __future__ import annotations

import threading
import warnings

_warned: set[str] = set()
_lock = threading.Lock()


def warn_once(message: str, stacklevel: int = 3) -> None:
    """Emits `message` as a RuntimeWarning the first time it is seen in this process."""
    with _lock:
        if message in _warned:
            return
        _warned.add(message)
    warnings.warn(message, RuntimeWarning, stacklevel=stacklevel)

"""The contract every backend implements.

A backend runs one *per-device, unbatched* call: the stack (stack.py) has
already folded vmap axes into the batch and split the call over the mesh, so
a backend sees plain arrays of one device. It never sees `vmap` or a sharding.
"""

from __future__ import annotations

from typing import Optional, Protocol

from maxattn._src.call import Call, Fwd, Grads, Saved


class Backend(Protocol):
    """What `implementation="<name>"` runs.

    `unsupported_reason` is the single place a backend states what it cannot
    run: auto mode falls back (warning once with the reason) and an explicit
    `implementation=` raises ValueError with it.
    """

    name: str

    def unsupported_reason(self, call: Call) -> Optional[str]:
        """None if the backend can run `call`, else the exact reason (a sentence fragment)."""
        ...

    def forward(self, call: Call) -> Fwd:
        """out [B, T, N, Hv] in the input dtype; lse f32 [B, N, T] iff call.options.lse;
        max_logit f32 [B, N] iff call.options.max_logit (per batch row)."""
        ...

    def backward(self, call: Call, saved: Saved) -> Grads:
        """dq, dk, dv like q, k, v; dbias f32 of the bias's shape iff the call has a bias;
        dsink f32 [B, N] (per batch row) iff it has sink logits."""
        ...

"""Context parallelism (sequence sharding): one module per strategy, selected by name.

Selected by `dot_product_attention(..., context_parallel=...)`:

* ``"all_gather"`` (all_gather.py): K/V gathered over the cp mesh axis,
  dK/dV reduce-scattered.
* ``"ring"`` (ring.py): K/V blocks rotated with `ppermute`, partial outputs
  merged through their lse, dK/dV travelling with their blocks.

Both run inside the partitioner's lowering (so they see per-device blocks and
may use collectives over mesh axis names) and call the backend's per-block
forward/backward: the same code serves every backend. What they share
(block calls, merge, seeds, sinks) is in blocks.py; which calls CP can run is
in spec.py.

The backward of every block uses the *global* lse and output of its query
rows (flash-attention backward), so the per-block gradients sum to the exact
gradient.

Attention sinks: every block runs the vanilla softmax; after the lse merge the
sink joins each query row once: lse' = logaddexp(lse, sink[n]),
out' = out * exp(lse - lse'). The backward blocks are again vanilla: with the
final (out', lse') their probabilities exp(s - lse') are the sink-softmax
ones, so dq/dk/dv are exact; dsink[b, n] = -sum_i exp(sink[n] - lse'_i) *
(<dout_i, out'_i> - dlse_i) is computed from the local rows and psum-ed over
the cp axis (per batch row, like without CP).

Dropout masks under CP are independent per block and reproducible for a key,
mesh and CP configuration, but not the unsharded call's mask (blocks.py).
"""

from __future__ import annotations

from types import ModuleType

from jax import lax

from maxattn._src.call import Call, Fwd, Grads, Saved
from maxattn._src.cp import all_gather, blocks, ring
from maxattn._src.cp.spec import ContextParallel, check_sizes, pmax_nan

__all__ = ["ContextParallel", "check_sizes", "forward", "backward"]

STRATEGIES: dict[str, ModuleType] = {"all_gather": all_gather, "ring": ring}


def _block_call(call: Call) -> Call:
    return call.replace(blocks.block_options(call.options, call.options.max_logit), sink_logits=None)


def forward(impl, call: Call, cp: ContextParallel, cp_size: int) -> Fwd:
    """Per-device CP forward, with the results `call.options` requests; max_logit
    [B, N] is reduced over the cp axis; with a sink, lse includes it."""
    rank = lax.axis_index(cp.axis)
    fwd = STRATEGIES[cp.strategy].forward(impl, _block_call(call), cp, cp_size, rank)
    out, lse = fwd.out, fwd.lse
    if call.operands.sink_logits is not None:
        out, lse = blocks.apply_sink(out, lse, call.operands.sink_logits)
    mx = pmax_nan(fwd.max_logit, cp.axis) if call.options.max_logit else None
    return Fwd(out.astype(call.operands.query.dtype), lse if call.options.lse else None, mx)


def backward(impl, call: Call, cp: ContextParallel, cp_size: int, saved: Saved) -> Grads:
    """Per-device CP backward: dq, dk, dv like the local q, k, v; with a sink also dsink
    f32 [B, N] (per local batch row, summed over the cp axis). `saved` holds the final
    (sink-including) forward results of the local rows."""
    rank = lax.axis_index(cp.axis)
    grads = STRATEGIES[cp.strategy].backward(impl, _block_call(call), cp, cp_size, rank, saved)
    sink = call.operands.sink_logits
    if sink is None:
        return grads
    return grads._replace(dsink=lax.psum(blocks.sink_grad(sink, saved), cp.axis))

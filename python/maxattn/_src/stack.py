"""The stack every fused call runs through, assembled once per (backend, context parallelism):

    custom_vjp  ∘  vmap fold (batching.py)  ∘  partition (partition.py, cp/)  ∘  backend

`custom_vjp` gives the gradient (through the backend's backward), the fold
turns vmap axes into batch rows once, the partitioner splits the call over the
mesh (and runs context parallelism), and the backend sees one device's
unbatched arrays.
"""

from __future__ import annotations

import functools
from typing import Callable, Optional

import jax
import jax.numpy as jnp

from maxattn._src import backends, batching, partition
from maxattn._src.call import Call, Fwd, Operands, Saved
from maxattn._src.cp import ContextParallel


def _first_order_only(fn: Callable, backend_name: str) -> Callable:
    """`fn` (the forward pass that saves residuals, or the backward), with a derivative
    rule that says clearly that there is none.

    Differentiating them (grad of grad, hessian, jvp of a grad) would otherwise
    fail deep inside custom_partitioning with an internal message."""

    @jax.custom_jvp
    def first_order(*args):
        return fn(*args)

    @first_order.defjvp
    def _no_second_order(primals, tangents):
        raise NotImplementedError(
            f'maxattn: the "{backend_name}" backend has no second-order derivatives (grad of grad, hessian, '
            'jvp of a gradient); use implementation="xla" (without context_parallel), which is plain JAX '
            'and differentiable to any order')

    return first_order


@functools.cache
def fused(backend_name: str, cp: Optional[ContextParallel]) -> Callable[[Call], Fwd]:
    """The differentiable function Call -> Fwd (lse / max_logit as the options request)."""
    impl = partition.Partitioned(backends.get(backend_name), cp)
    forward = batching.fold(impl.forward)
    saving_forward = _first_order_only(forward, backend_name)
    backward = _first_order_only(batching.fold(impl.backward), backend_name)

    @jax.custom_vjp
    def attention(call: Call) -> Fwd:
        return forward(call)

    def attention_fwd(call: Call):
        res = saving_forward(call.replace(call.options.replace(lse=True)))
        return Fwd(res.out, res.lse if call.options.lse else None, res.max_logit), (call, res.out, res.lse)

    def attention_bwd(residuals, ct: Fwd):
        call, out, lse = residuals
        dlse = ct.lse if call.options.lse else None  # max_logit carries no gradient
        g = backward(call, Saved(out, lse, ct.out, dlse))
        ops = call.operands
        sink_ct = None
        if ops.sink_logits is not None:
            # Per batch row [B, N] from the backend; the sum over B (and, under
            # sharding, over the batch shards) is the [N] gradient.
            sink_ct = jnp.sum(g.dsink, axis=0).astype(ops.sink_logits.dtype)
        cts = Operands(g.dq, g.dk, g.dv, None if g.dbias is None else g.dbias.astype(ops.bias.dtype),
                       sink_logits=sink_ct)
        return (Call(call.options, cts),)

    attention.defvjp(attention_fwd, attention_bwd)
    return attention

"""The `ContextParallel` value and the rules of which calls context parallelism can run."""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import jax.numpy as jnp
from jax import lax

from maxattn._src.call import Call

STRATEGIES = ("all_gather", "ring")


@dataclasses.dataclass(frozen=True)
class ContextParallel:
    """Static description of the requested context parallelism (the public
    keywords `context_parallel`, `context_parallel_axis`, `load_balanced`)."""

    strategy: str
    axis: str
    load_balanced: bool


def make_spec(context_parallel: Any, context_parallel_axis: Any, load_balanced: Any) -> Optional[ContextParallel]:
    """Validates the public CP arguments; None when CP is not requested."""
    if not isinstance(load_balanced, bool):
        raise TypeError(f"`load_balanced` must be a Python bool, got {type(load_balanced).__name__}")
    if context_parallel is None:
        if context_parallel_axis is not None:
            raise ValueError("`context_parallel_axis` was given but `context_parallel` is None; "
                             f"pass context_parallel={STRATEGIES[0]!r} or {STRATEGIES[1]!r}")
        if load_balanced:
            raise ValueError("`load_balanced=True` requires `context_parallel` ('all_gather' or 'ring')")
        return None
    if context_parallel not in STRATEGIES:
        raise ValueError(f"`context_parallel` must be None, 'all_gather' or 'ring', got {context_parallel!r}")
    if not isinstance(context_parallel_axis, str) or not context_parallel_axis:
        raise ValueError("`context_parallel_axis` must name the mesh axis that shards the sequence "
                         f"(a non-empty str) when `context_parallel` is set, got {context_parallel_axis!r}")
    return ContextParallel(context_parallel, context_parallel_axis, load_balanced)


def check_supported(cp: ContextParallel, call: Call) -> None:
    """Raises ValueError for the configurations context parallelism cannot run."""
    what = f"context_parallel={cp.strategy!r}"
    ops, mask = call.operands, call.options.mask
    if ops.bias is not None:
        raise ValueError(f"{what} does not support `bias` (only no mask or causal, with optional "
                         "padding lengths / segment ids)")
    if ops.mask is not None:
        raise ValueError(f"{what} does not support a boolean `mask`; use is_causal, sequence lengths or "
                         "segment ids")
    if mask.windowed:
        raise ValueError(f"{what} does not support `local_window_size`")
    if mask.causal and mask.bottom_right:
        raise ValueError(f"{what} supports only causal_alignment='top_left'")
    if mask.causal and call.q_len != call.kv_len:
        raise ValueError(f"{what} with is_causal=True requires equal query and key lengths, got "
                         f"T={call.q_len}, S={call.kv_len}")


def check_sizes(cp: ContextParallel, cp_size: int, T: int, S: int) -> None:
    per = 2 * cp_size if cp.load_balanced else cp_size
    for name, n in (("query", T), ("key/value", S)):
        if n % per:
            raise ValueError(f"context_parallel: the {name} sequence length {n} must be divisible by "
                             f"{'2 * ' if cp.load_balanced else ''}the size {cp_size} of mesh axis "
                             f"{cp.axis!r} (= {per})")


def max_nan(x, axis: int, keepdims: bool = False):
    """`jnp.max` over `axis` that propagates NaN (XLA's CPU reduction need not); -inf when empty."""
    top = jnp.max(x, axis=axis, keepdims=keepdims, initial=-jnp.inf)
    return jnp.where(jnp.any(jnp.isnan(x), axis=axis, keepdims=keepdims), jnp.nan, top)


def pmax_nan(x, axis):
    """`lax.pmax` that propagates NaN: a collective max need not, and max_logit must."""
    any_nan = lax.pmax(jnp.isnan(x).astype(jnp.int32), axis) > 0
    return jnp.where(any_nan, jnp.nan, lax.pmax(x, axis))

"""The call shared by the linen and nnx ``DotProductAttention`` modules.

Both modules hold the same settings (linen as fields, nnx as constructor
keywords), documented once in :mod:`maxattn.flax`, and share `module_call` as
their ``__call__``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Optional, Protocol, Union

import jax

import maxattn
from maxattn.flax import flatten_batch_axes, sow_max_logit, unflatten_batch_axes

#: ``out``, or ``(out, aux)`` with ``aux`` holding ``"max_logit"`` and / or ``"lse"``.
AttentionResult = Union[jax.Array, tuple[jax.Array, dict[str, jax.Array]]]


class AttentionModule(Protocol):
    """The settings both ``DotProductAttention`` modules hold (and ``sow``)."""

    scale: Optional[float]
    is_causal: bool
    implementation: Optional[str]
    return_max_logit: bool
    return_lse: bool
    record_max_logit: bool
    attention_kwargs: Optional[Mapping[str, Any]]

    def sow(self, *args: Any, **kwargs: Any) -> Any: ...


def call_dot_product_attention(
    module: AttentionModule, query: jax.Array, key: jax.Array, value: jax.Array,
    bias: Optional[jax.Array], mask: Optional[jax.Array], kwargs: Mapping[str, Any],
) -> AttentionResult:
    """Runs :func:`maxattn.dot_product_attention` with ``module``'s settings.

    ``kwargs`` (per call) override ``module.attention_kwargs`` (fixed). The max
    logit is sown into ``module`` when ``record_max_logit`` is set. Returns
    ``out``, or ``(out, aux)`` when ``return_max_logit`` or ``return_lse`` is
    set (``aux`` holds only the requested entries).
    """
    want_max = module.return_max_logit or module.record_max_logit
    q, k, v, bias, mask, batch_shape = flatten_batch_axes(query, key, value, bias, mask)
    res = maxattn.dot_product_attention(
        q, k, v, bias, mask, scale=module.scale, is_causal=module.is_causal,
        implementation=module.implementation, return_max_logit=want_max,
        return_lse=module.return_lse, **{**(module.attention_kwargs or {}), **kwargs})
    if not (want_max or module.return_lse):
        return unflatten_batch_axes(res, batch_shape)
    out, aux = res
    out = unflatten_batch_axes(out, batch_shape)
    if "lse" in aux:
        aux = {**aux, "lse": unflatten_batch_axes(aux["lse"], batch_shape)}
    if module.record_max_logit:
        sow_max_logit(module, aux["max_logit"])
    if not (module.return_max_logit or module.return_lse):
        return out
    if not module.return_max_logit:
        aux = {k: v for k, v in aux.items() if k != "max_logit"}
    return out, aux


def module_call(self: AttentionModule, query: jax.Array, key: jax.Array, value: jax.Array,
                bias: Optional[jax.Array] = None, mask: Optional[jax.Array] = None,
                **kwargs: Any) -> AttentionResult:
    """Attention on [batch..., T, N, H] / [batch..., S, K, H] / [batch..., S, K, Hv] inputs.

    Any number of leading batch axes, none included, as Flax's attention
    (they are folded into one batch axis for the kernel). ``kwargs`` go to
    :func:`maxattn.dot_product_attention` (e.g. sequence lengths, segment ids,
    given for the folded batch) and override the module's
    ``attention_kwargs``. Returns ``out`` [batch..., T, N, Hv], or
    ``(out, aux)`` when ``return_max_logit`` or ``return_lse`` is set
    (``aux["lse"]`` [batch..., N, T]).
    """
    return call_dot_product_attention(self, query, key, value, bias, mask, kwargs)

"""``DotProductAttention`` as a ``flax.linen`` module."""

from __future__ import annotations

from typing import Optional

from flax import linen as nn

from maxattn.flax._module_call import module_call

__all__ = ["DotProductAttention"]


class DotProductAttention(nn.Module):
    """maxattn attention as a linen module (no parameters).

    Its fields are the module settings listed in :mod:`maxattn.flax`
    (``record_max_logit`` sows into the ``"intermediates"`` collection, a no-op
    unless it is mutable). Call it as ``module(query, key, value, bias=None,
    mask=None, **kwargs)``.
    """

    scale: Optional[float] = None
    is_causal: bool = False
    implementation: Optional[str] = None
    return_max_logit: bool = False
    return_lse: bool = False
    record_max_logit: bool = False
    attention_kwargs: Optional[dict] = None

    __call__ = module_call

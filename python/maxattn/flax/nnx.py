"""``DotProductAttention`` as a ``flax.nnx`` module."""

from __future__ import annotations

from typing import Any, Optional

from flax import nnx

from maxattn.flax._module_call import module_call

__all__ = ["DotProductAttention"]


class DotProductAttention(nnx.Module):
    """maxattn attention as an nnx module (no parameters).

    Its constructor keywords are the module settings listed in
    :mod:`maxattn.flax`; further keywords become ``attention_kwargs``
    (``record_max_logit`` sows as ``nnx.Intermediate``; read it with
    :func:`maxattn.flax.capture_max_logits`). Call it as ``module(query, key,
    value, bias=None, mask=None, **kwargs)``.
    """

    def __init__(self, *, scale: Optional[float] = None, is_causal: bool = False,
                 implementation: Optional[str] = None, return_max_logit: bool = False,
                 return_lse: bool = False, record_max_logit: bool = False,
                 **attention_kwargs: Any):
        self.scale = scale
        self.is_causal = is_causal
        self.implementation = implementation
        self.return_max_logit = return_max_logit
        self.return_lse = return_lse
        self.record_max_logit = record_max_logit
        self.attention_kwargs = dict(attention_kwargs)

    __call__ = module_call

"""``DotProductAttention`` as a ``flax.linen`` module."""

from __future__ import annotations

from typing import Any, Optional

import jax
from flax import linen as nn

from maxattn.flax._module_call import AttentionResult, call_dot_product_attention

__all__ = ["DotProductAttention"]


class DotProductAttention(nn.Module):
    """maxattn attention as a linen module (no parameters).

    Attributes:
      scale: logit scale (default 1/sqrt(H)).
      is_causal: causal mask.
      implementation: maxattn backend (None = auto, "cpu", "cudnn", "xla").
      return_max_logit: return ``(out, aux)`` with ``aux["max_logit"]``
        float32 [N], like TransformerEngine's ``fused_attn``.
      return_lse: also return ``aux["lse"]`` float32 [B, N, T].
      record_max_logit: sow the max logit into the ``"intermediates"``
        collection under ``"max_logit"`` (a no-op unless the collection is
        mutable).
      attention_kwargs: further fixed keyword arguments for
        :func:`maxattn.dot_product_attention` (e.g. ``local_window_size``).
    """

    scale: Optional[float] = None
    is_causal: bool = False
    implementation: Optional[str] = None
    return_max_logit: bool = False
    return_lse: bool = False
    record_max_logit: bool = False
    attention_kwargs: Optional[dict] = None

    @nn.compact
    def __call__(self, query: jax.Array, key: jax.Array, value: jax.Array,
                 bias: Optional[jax.Array] = None, mask: Optional[jax.Array] = None,
                 **kwargs: Any) -> AttentionResult:
        """Attention on [B, T, N, H] / [B, S, K, H] / [B, S, K, Hv] inputs.

        ``kwargs`` go to :func:`maxattn.dot_product_attention` (e.g. sequence
        lengths, segment ids). Returns ``out`` [B, T, N, Hv], or ``(out, aux)``
        when ``return_max_logit`` or ``return_lse`` is set.
        """
        return call_dot_product_attention(self, query, key, value, bias, mask, kwargs)

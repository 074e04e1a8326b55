"""maxattn: fused attention for JAX that also returns the per-head max logit and the LSE.

Public API:
  dot_product_attention  -- attention with optional ``max_logit`` / ``lse`` outputs
  reference              -- the pure-JAX implementation (``implementation="xla"``)
"""

from maxattn._src.api import dot_product_attention as dot_product_attention
from maxattn._src.api import reference_attention as reference

__all__ = ["dot_product_attention", "reference"]
__version__ = "0.1.0"

"""maxattn: fused attention for JAX that also returns the per-head max logit and the LSE.

Public API:
  dot_product_attention  -- attention with optional ``max_logit`` / ``lse`` outputs
  reference              -- the pure-JAX implementation (``implementation="xla"``)
  reorder_for_load_balancing / inverse_reorder_for_load_balancing
                         -- dual-chunk sequence layout for load-balanced causal context parallelism
"""

from maxattn._src.api import dot_product_attention as dot_product_attention
from maxattn._src.api import reference_attention as reference
from maxattn._src.load_balance import inverse_reorder_for_load_balancing as inverse_reorder_for_load_balancing
from maxattn._src.load_balance import reorder_for_load_balancing as reorder_for_load_balancing
from maxattn._src.info import show_config as show_config

__all__ = ["dot_product_attention", "reference", "reorder_for_load_balancing",
           "inverse_reorder_for_load_balancing", "show_config"]
__version__ = "0.1.0"

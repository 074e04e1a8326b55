"""QK-Clip (Kimi K2's MuonClip; Megatron-LM ``--qk-clip``) for Flax parameters.

After an optimizer step, every attention head h whose max logit S_max(h) from
that step's forward pass exceeds the threshold τ gets its query and key
projections rescaled so that the head's logits shrink by η = τ / S_max(h):

    η(h)      = min(1, τ / S_max(h))        (η = 1 when S_max ≤ 0, -inf or NaN)
    W_q[:, h] ← η^α     · W_q[:, h]         (and the query bias b_q[h])
    W_k[:, h] ← η^(1-α) · W_k[:, h]         (and the key bias b_k[h])

Logits are bilinear in q and k, so every logit of head h scales by exactly η
and the new max logit is min(S_max, τ). This holds with rotary embeddings
(rotations commute with scaling) and with q/k biases (scaled too), but not
with QK-norm (which undoes the scaling; you would not need QK-Clip then).
Heads at or under τ are left bit-for-bit unchanged.

GQA/MQA (N query heads, K kv heads, group size G = N // K; query head n uses
kv head n // G): a kv head is shared by its G query heads, so η is computed
per group from the group's largest max logit (Megatron's rule):
η_g = min(1, τ / max_{n in g} S_max(n)); query heads of the group get η_g^α,
the kv head gets η_g^(1-α). The group's largest head lands exactly on τ and
the group's other heads scale by the same η_g (so they end below τ).

Entry points:

* :func:`clip_factors` -- the per-head factors;
* :func:`apply_qk_clip` -- rescales a Flax parameter tree (the [D, N, H]
  query/key kernels and [N, H] biases of ``nnx.MultiHeadAttention`` and
  ``nn.MultiHeadDotProductAttention``; leading scan axes allowed), with a
  ``rule`` hook for custom layouts (e.g. MLA);
* :func:`qk_clip_transform` -- the same as an optax transform to chain after
  any optimizer; it takes the step's max logits as an extra argument.

The max logits come from :mod:`maxattn.flax` (sown as ``"max_logit"``) and are
matched to parameters by module path (see :func:`maxattn.flax.collect_max_logits`).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp

__all__ = ["clip_factors", "apply_qk_clip", "qk_clip_transform", "default_rule", "mla_rule"]

#: A layout rule: ``rule(rel_path, leaf) -> None | (kind, head_axis)``.
#: ``rel_path`` is the leaf's path below the attention module (a tuple of
#: str/int keys, e.g. ``("query", "kernel")``); ``kind`` is "q" (multiply by
#: η^α along ``head_axis``, a query-head axis of length N), "k" (η^(1-α), a
#: kv-head axis of length K) or "eta" (η itself, query-head axis of length N);
#: None leaves the leaf alone. ``head_axis`` is negative (counted from the end),
#: so leading scan axes are allowed.
Rule = Callable[[tuple, jax.Array], Optional[tuple[str, int]]]


def default_rule(query_name: str = "query", key_name: str = "key") -> Rule:
    """The rule for Flax's MultiHeadAttention layouts.

    ``{query_name}/kernel`` [D, N, H] and ``{query_name}/bias`` [N, H] get the
    q factor, ``{key_name}/kernel`` [D, K, H] and ``{key_name}/bias`` [K, H] the
    k factor; the head axis is -2 in all four.
    """
    def rule(rel_path, leaf):
        if len(rel_path) == 2 and rel_path[1] in ("kernel", "bias"):
            if rel_path[0] == query_name:
                return ("q", -2)
            if rel_path[0] == key_name:
                return ("k", -2)
        return None
    return rule


def mla_rule(q_nope: str = "q_nope", q_rope: str = "q_rope", k_nope: str = "k_nope",
             head_axis: int = -2) -> Rule:
    """An example rule for MLA (Kimi K2 report, Sec. 2.1): per-head parts only.

    The head-specific non-rotary parts get √η each (``alpha=0.5``: "q" on
    ``q_nope``, "k" on ``k_nope``), the head-specific rotary query part gets η,
    and the shared rotary key is left alone. Use with ``alpha=0.5`` and a
    per-head k_nope projection (K = N). Submodules are matched by name, any
    parameter inside them (kernel/bias) is scaled along ``head_axis``.
    """
    def rule(rel_path, leaf):
        if not rel_path:
            return None
        head = rel_path[0]
        if head == q_nope:
            return ("q", head_axis)
        if head == k_nope:
            return ("k", head_axis)
        if head == q_rope:
            return ("eta", head_axis)
        return None
    return rule


def _check_hparams(threshold, alpha):
    if isinstance(threshold, (int, float)) and not threshold > 0:
        raise ValueError(f"threshold must be > 0, got {threshold}")
    if isinstance(alpha, (int, float)) and not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must be in [0, 1], got {alpha}")


def _eta(max_logit, threshold, num_kv_heads):
    s = jnp.asarray(max_logit, jnp.float32)
    if s.ndim < 1:
        raise ValueError("`max_logit` must have shape [..., N], got a scalar")
    n = s.shape[-1]
    k = n if num_kv_heads is None else int(num_kv_heads)
    if k <= 0 or n % k:
        raise ValueError(
            f"num_kv_heads must divide the number of query heads N={n}, got {num_kv_heads}")
    g = n // k
    s = jnp.where(jnp.isnan(s), -jnp.inf, s)  # a NaN head never causes (or blocks) a clip
    s = jnp.max(s.reshape(s.shape[:-1] + (k, g)), axis=-1)  # [..., K]
    threshold = jnp.asarray(threshold, jnp.float32)
    clip = s > threshold  # False for S <= 0, -inf, NaN (threshold > 0)
    eta = jnp.where(clip, threshold / jnp.where(clip, s, 1.0), 1.0)
    return eta, clip, g


def _pow(eta, clip, exponent):
    return jnp.where(clip, eta ** jnp.asarray(exponent, jnp.float32), 1.0)


def clip_factors(max_logit: jax.Array, threshold: float = 100.0, alpha: float = 0.5,
                 num_kv_heads: Optional[int] = None) -> tuple[jax.Array, jax.Array]:
    """Per-head QK-Clip scale factors.

    Args:
      max_logit: float [..., N], the per-query-head max logit of the step
        (e.g. ``aux["max_logit"]``); leading axes (scan layers) are kept.
      threshold: τ > 0.
      alpha: the share of the correction put on the query side, in [0, 1].
      num_kv_heads: K for GQA/MQA (N % K == 0); None means K = N.

    Returns:
      ``(q_factor, k_factor)``: float32 [..., N] and [..., K]. With
      η = min(1, τ / S) per kv group (S = max over the group's query heads,
      NaN heads ignored), q_factor = η^α for every query head of the group and
      k_factor = η^(1-α). η = 1 -- both factors exactly 1.0 -- where S ≤ τ,
      S ≤ 0, S = -inf or S is NaN; the result is never NaN.

    Raises:
      ValueError: if threshold ≤ 0, alpha is outside [0, 1], or num_kv_heads
        does not divide N.
    """
    _check_hparams(threshold, alpha)
    eta, clip, g = _eta(max_logit, threshold, num_kv_heads)
    q = jnp.repeat(_pow(eta, clip, alpha), g, axis=-1)
    k = _pow(eta, clip, 1.0 - alpha)
    return q, k


def _scale_leaf(leaf, factor, head_axis, where):
    """leaf[..., heads at head_axis, ...] * factor[lead..., heads]."""
    leaf = jnp.asarray(leaf)
    if head_axis >= 0:
        raise ValueError(f"rule head_axis must be negative (from the end), got {head_axis} at {where}")
    if leaf.ndim < -head_axis:
        raise ValueError(f"parameter at {where} has shape {leaf.shape}; no axis {head_axis}")
    if leaf.shape[head_axis] != factor.shape[-1]:
        raise ValueError(
            f"parameter at {where} has {leaf.shape[head_axis]} heads on axis {head_axis} "
            f"(shape {leaf.shape}), but the max logits give {factor.shape[-1]}")
    lead = factor.shape[:-1]
    between = leaf.ndim + head_axis - len(lead)
    if between < 0 or tuple(leaf.shape[: len(lead)]) != tuple(lead):
        raise ValueError(
            f"parameter at {where} has shape {leaf.shape}, whose leading axes do not match "
            f"the max logits' leading axes {lead}")
    f = factor.reshape(lead + (1,) * between + (factor.shape[-1],) + (1,) * (-head_axis - 1))
    scaled = (leaf * f).astype(leaf.dtype)
    return jnp.where(f != 1.0, scaled, leaf)  # untouched heads bit for bit


def _match(params, max_logits, rule):
    """-> leaves, treedef, {prefix: [(leaf index, rel_path, kind, axis)]}."""
    from maxattn.flax import collect_max_logits, normalize_path

    ml = collect_max_logits(max_logits)
    if not ml:
        raise ValueError(
            "max_logits holds no 'max_logit' entries: record them with maxattn.flax "
            "(call Flax attention layers with sow_weights=True)")
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    matches: dict[tuple, list] = {p: [] for p in ml}
    for i, (path, leaf) in enumerate(flat):
        p = normalize_path(path)
        if p[:1] == ("params",):
            p = p[1:]
        if p and p[-1] in ("value", "raw_value"):
            p = p[:-1]
        for cut in range(len(p), -1, -1):  # longest module prefix first
            if p[:cut] in ml:
                r = rule(p[cut:], leaf)
                if r is not None:
                    matches[p[:cut]].append((i, p[cut:], r[0], r[1]))
                break
    for prefix, m in matches.items():
        kinds = {k for _, _, k, _ in m}
        if not kinds & {"q", "eta"} or not kinds & {"k", "eta"}:
            raise ValueError(
                f"max_logits has an entry for module {prefix}, but params has no matching "
                f"query and key parameters under it (found {[r for _, r, _, _ in m]}); "
                "pass query_name/key_name or a rule for custom layouts")
    return [leaf for _, leaf in flat], treedef, ml, matches


def apply_qk_clip(params: Any, max_logits: Any, *, threshold: float = 100.0,
                  alpha: float = 0.5, query_name: str = "query", key_name: str = "key",
                  rule: Optional[Rule] = None) -> Any:
    """Rescales the query/key projections of every head whose max logit exceeds τ.

    Args:
      params: the parameter pytree (linen ``params`` dict, with or without the
        top-level ``"params"`` key; an nnx ``State``; any pytree of arrays).
      max_logits: the step's max logits, matched to attention modules by path:
        the sown intermediates (linen ``intermediates`` collection, nnx
        ``State`` of ``Intermediate``) or a ``{module_path: float[..., N]}``
        dict (see :func:`maxattn.flax.collect_max_logits`). Leading axes
        (e.g. [L, N] under a layer scan) must match the parameters' leading axes.
      threshold: τ > 0.
      alpha: share of the correction on the query side, in [0, 1].
      query_name, key_name: submodule names for the default rule.
      rule: custom layout hook (see :data:`Rule`, :func:`default_rule`,
        :func:`mla_rule`); defaults to ``default_rule(query_name, key_name)``.
        The number of kv heads K is read from the first "k" leaf's head axis.

    Returns:
      A pytree like ``params`` with the matched leaves rescaled (in their own
      dtype) and everything else -- and every unclipped head -- unchanged.

    Raises:
      ValueError: if max_logits is empty, a module in max_logits has no query
        and key parameters, or head counts / leading axes disagree.
    """
    _check_hparams(threshold, alpha)
    rule = rule or default_rule(query_name, key_name)
    leaves, treedef, ml, matches = _match(params, max_logits, rule)
    leaves = list(leaves)
    for prefix, m in matches.items():
        s = jnp.asarray(ml[prefix], jnp.float32)
        kv = [jnp.shape(leaves[i])[ax] for i, _, kind, ax in m if kind == "k"]
        num_kv = kv[0] if kv else None
        q_f, k_f = clip_factors(s, threshold, alpha, num_kv)
        eta, clip, g = _eta(s, threshold, num_kv)
        eta_q = jnp.repeat(jnp.where(clip, eta, 1.0), g, axis=-1)
        factor = {"q": q_f, "k": k_f, "eta": eta_q}
        for i, rel, kind, ax in m:
            if kind not in factor:
                raise ValueError(f"rule returned unknown kind {kind!r} for {prefix + rel}")
            leaves[i] = _scale_leaf(leaves[i], factor[kind], ax, prefix + rel)
    return jax.tree_util.tree_unflatten(treedef, leaves)


class QKClipState(NamedTuple):
    """Empty state of :func:`qk_clip_transform`."""


def qk_clip_transform(threshold: float = 100.0, alpha: float = 0.5, *,
                      query_name: str = "query", key_name: str = "key",
                      rule: Optional[Rule] = None):
    """QK-Clip as an optax transform, to chain after any optimizer.

    ``update(updates, state, params, *, max_logits)`` returns updates ``u'``
    such that ``optax.apply_updates(params, u') == apply_qk_clip(params +
    updates, max_logits)`` (exact for unclipped heads; to rounding of one
    subtraction for clipped ones). ``max_logits`` are those measured in the
    forward pass of this step (as in Kimi K2 / Megatron). Works under jit and
    with sharded parameters (elementwise math only)::

        tx = optax.chain(optax.adamw(1e-3), maxattn.qk_clip.qk_clip_transform(100.0))
        updates, opt_state = tx.update(grads, opt_state, params, max_logits=max_logits)

    With ``nnx.Optimizer``: ``optimizer.update(model, grads, max_logits=...)``.

    Args:
      threshold, alpha, query_name, key_name, rule: as in :func:`apply_qk_clip`.

    Returns:
      An ``optax.GradientTransformationExtraArgs``. ``update`` raises
      ValueError when ``params`` or ``max_logits`` is missing.
    """
    import optax

    _check_hparams(threshold, alpha)

    def init_fn(params):
        del params
        return QKClipState()

    def update_fn(updates, state, params=None, *, max_logits=None, **extra_args):
        del extra_args
        if params is None:
            raise ValueError("qk_clip_transform.update needs params")
        if max_logits is None:
            raise ValueError("qk_clip_transform.update needs the keyword argument max_logits")
        new_params = optax.apply_updates(params, updates)
        clipped = apply_qk_clip(new_params, max_logits, threshold=threshold, alpha=alpha,
                                query_name=query_name, key_name=key_name, rule=rule)

        def fix(u, p, new, c):
            if u is None:
                return None
            changed = c != new
            return jnp.where(changed, (jnp.asarray(c) - p).astype(jnp.asarray(u).dtype), u)

        updates = jax.tree.map(fix, updates, params, new_params, clipped,
                               is_leaf=lambda x: x is None)
        return updates, state

    return optax.GradientTransformationExtraArgs(init_fn, update_fn)

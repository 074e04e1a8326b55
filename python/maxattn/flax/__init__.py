"""Flax integration: an ``attention_fn`` that records the per-head max logit.

``maxattn.flax.attention_fn`` drops into the two standard Flax attention layers::

    flax.nnx.MultiHeadAttention(..., attention_fn=maxattn.flax.attention_fn)
    flax.linen.MultiHeadDotProductAttention(..., attention_fn=maxattn.flax.attention_fn)

and runs :func:`maxattn.dot_product_attention`. When the layer passes its own
module (both layers do that only when called with ``sow_weights=True``), the
per-head max logit, float32 ``[N]``, is *sown* into the module:

* linen: collection ``"intermediates"``, name ``"max_logit"`` (read it with
  ``model.apply(..., mutable=["intermediates"])``);
* nnx: variable type ``nnx.Intermediate``, name ``"max_logit"`` (read it with
  ``nnx.capture`` on new Flax, ``nnx.pop(model, nnx.Intermediate)`` on old
  Flax, or just use :func:`capture_max_logits`, which picks the right one).

Sown values follow Flax's default ``sow`` reduction (a tuple, one entry per
call). Under ``nn.scan`` / ``nnx.scan`` over layers the entries gain a leading
layer axis (``[L, N]``). :func:`collect_max_logits` turns any of these
containers into ``{module_path: float32[..., N]}``, the form that
:mod:`maxattn.qk_clip` consumes.

The sown value carries no gradient. ``DotProductAttention`` modules for linen
and nnx live in :mod:`maxattn.flax.linen` and :mod:`maxattn.flax.nnx`. Both
take the same settings (linen: fields; nnx: constructor keywords):

* ``scale``: logit scale (default 1/sqrt(H));
* ``is_causal``: causal mask;
* ``implementation``: maxattn backend (None = auto, "cpu", "cudnn", "xla");
* ``return_max_logit``: return ``(out, aux)`` with ``aux["max_logit"]``
  float32 [N], like TransformerEngine's ``fused_attn``;
* ``return_lse``: also return ``aux["lse"]`` float32 [B, N, T];
* ``record_max_logit``: sow the max logit under ``"max_logit"`` (as above);
* ``attention_kwargs``: further fixed keyword arguments for
  :func:`maxattn.dot_product_attention` (e.g. ``local_window_size``); a call's
  own keyword arguments override them.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp

import maxattn

__all__ = [
    "SOW_NAME",
    "attention_fn",
    "make_attention_fn",
    "collect_max_logits",
    "capture_max_logits",
    "sow_max_logit",
]

#: Name under which the per-head max logit is sown.
SOW_NAME = "max_logit"


def sow_max_logit(module: Any, value: jax.Array, name: str = SOW_NAME) -> None:
    """Sows ``value`` (float32 [N]) into a linen or nnx ``module``.

    linen: collection ``"intermediates"``; nnx: ``nnx.Intermediate``. Both use
    Flax's default tuple-append reduction.

    Raises:
      TypeError: if ``module`` is neither a linen nor an nnx Module.
    """
    from flax import linen as nn
    from flax import nnx

    if isinstance(module, nnx.Module):
        module.sow(nnx.Intermediate, name, value)
    elif isinstance(module, nn.Module):
        module.sow("intermediates", name, value)
    else:
        raise TypeError(
            f"module must be a flax.linen.Module or flax.nnx.Module to sow {name!r}, "
            f"got {type(module).__name__}")


def _flatten_batch(x: jax.Array, batch_shape: tuple[int, ...], trailing: int) -> jax.Array:
    """[batch..., *trailing dims] -> [B, *trailing dims] (broadcasting batch dims first)."""
    if x.ndim < trailing:
        return x
    lead = x.shape[: x.ndim - trailing]
    if len(lead) == 1 and len(batch_shape) == 1:
        return x
    if len(lead) != len(batch_shape):
        # Fewer leading dims than the batch: standard numpy broadcasting from the right.
        x = x.reshape((1,) * (len(batch_shape) - len(lead)) + x.shape)
    x = jnp.broadcast_to(x, tuple(batch_shape) + x.shape[len(batch_shape):])
    return x.reshape((-1,) + x.shape[len(batch_shape):])


def flatten_batch_axes(query, key, value, bias=None, mask=None):
    """Flax's layout -> maxattn's: any number (zero included) of leading batch axes
    folded into one.

    ``query`` [batch..., T, N, H], ``key`` [batch..., S, K, H], ``value``
    [batch..., S, K, Hv]; ``bias`` and ``mask`` broadcastable to [batch..., N, T,
    S] (a non-boolean mask is "nonzero = attend", as Flax's make_causal_mask).
    Returns (q, k, v, bias, mask) as [B, ...] arrays and the batch shape, so that
    a [B, ...] result `r` is ``r.reshape(batch_shape + r.shape[1:])``.
    """
    if query.ndim < 3:
        raise ValueError(f"`query` must have shape [batch..., T, N, H], got {query.shape}")
    batch_shape = query.shape[:-3]
    flat_batch = batch_shape if batch_shape else (1,)

    def flat(x):
        if x.ndim == 3 and not batch_shape:
            return x[None]
        return _flatten_batch(x, flat_batch, 3)

    q, k, v = flat(query), flat(key), flat(value)
    if mask is not None:
        mask = jnp.asarray(mask)
        if mask.dtype != jnp.bool_:  # Flax masks (make_causal_mask etc.) are float 0/1
            mask = mask != 0
        mask = _flatten_batch(mask, flat_batch, 3)
    if bias is not None:
        bias = _flatten_batch(jnp.asarray(bias), flat_batch, 3)
    return q, k, v, bias, mask, batch_shape


def unflatten_batch_axes(x: jax.Array, batch_shape: tuple[int, ...]) -> jax.Array:
    """The inverse of `flatten_batch_axes` for a [B, ...] result."""
    return x.reshape(tuple(batch_shape) + x.shape[1:])


def _attention(
    query, key, value, bias=None, mask=None, broadcast_dropout=True, dropout_rng=None,
    dropout_rate=0.0, deterministic=False, dtype=None, precision=None, module=None,
    is_causal=False, *, _record: bool, _implementation, _name: str, _kwargs: dict,
):
    # Attention dropout runs inside the kernel when not deterministic; the mask is
    # drawn per (batch, head, query, key) (broadcast_dropout is not honoured: the
    # mask is never shared across the batch).
    dropout_kwargs = {}
    if dropout_rate > 0.0 and not deterministic:
        if dropout_rng is None:
            raise ValueError("maxattn.flax.attention_fn: `dropout_rng` is required when dropout_rate > 0 "
                             "and deterministic is False (Flax modules pass the 'dropout' rng stream)")
        dropout_kwargs = dict(dropout_rate=float(dropout_rate), dropout_rng=dropout_rng)
    del broadcast_dropout, precision  # precision: maxattn accumulates in float32
    if dtype is not None:
        query, key, value = (jnp.asarray(t, dtype) for t in (query, key, value))
    else:
        common = jnp.result_type(query, key, value)
        query, key, value = (jnp.asarray(t, common) for t in (query, key, value))
    q, k, v, bias, mask, batch_shape = flatten_batch_axes(query, key, value, bias, mask)
    kwargs = dict(_kwargs)
    kwargs["is_causal"] = bool(is_causal) or bool(kwargs.get("is_causal", False))
    record = _record and module is not None
    result = maxattn.dot_product_attention(
        q, k, v, bias, mask, implementation=_implementation, return_max_logit=record, **dropout_kwargs,
        **kwargs)
    if record:
        out, aux = result
        sow_max_logit(module, aux["max_logit"], _name)
    else:
        out = result
    return unflatten_batch_axes(out, batch_shape)


def make_attention_fn(
    record_max_logit: bool = True,
    implementation: Optional[str] = None,
    *,
    sow_name: str = SOW_NAME,
    **attention_kwargs: Any,
) -> Callable[..., jax.Array]:
    """Returns an ``attention_fn`` for Flax attention layers that runs maxattn.

    The returned function has the call signature of Flax's
    ``dot_product_attention``: ``(query, key, value, bias=None, mask=None,
    broadcast_dropout=True, dropout_rng=None, dropout_rate=0.0,
    deterministic=False, dtype=None, precision=None, module=None,
    is_causal=False)``, with ``query`` [batch..., T, N, H], ``key`` [batch...,
    S, K, H], ``value`` [batch..., S, K, Hv] (N % K == 0 for GQA), ``mask``
    broadcastable to [batch..., N, T, S] (True / nonzero = attend, as in Flax,
    whose ``make_causal_mask`` returns float 0/1) and ``bias``
    additive, broadcastable likewise. It returns [batch..., T, N, Hv].
    ``precision`` is ignored (maxattn accumulates in float32); ``dtype``, when
    given, casts query/key/value. Attention dropout (``dropout_rate > 0`` and
    ``deterministic=False``) runs in the kernel with ``dropout_rng``; the mask
    is independent per batch row (``broadcast_dropout`` is ignored).

    Args:
      record_max_logit: sow the per-head max logit (float32 [N]) into
        ``module`` when the layer passes one (Flax's MultiHeadAttention layers
        do so only when called with ``sow_weights=True``).
      implementation: maxattn backend (None = auto, "cpu", "cudnn", "xla").
      sow_name: name to sow under (default ``"max_logit"``).
      **attention_kwargs: fixed keyword arguments for
        :func:`maxattn.dot_product_attention` (e.g. ``is_causal=True``,
        ``scale=...``, ``local_window_size=...``, ``logits_soft_cap=...``).
        ``is_causal`` is OR-ed with the layer's ``is_causal``.

    Raises:
      TypeError: if ``attention_kwargs`` holds an argument the attention_fn
        owns (``implementation``, ``return_max_logit``, ``return_lse``,
        ``bias``, ``mask``).
    """
    for bad in ("implementation", "return_max_logit", "return_lse", "bias", "mask"):
        if bad in attention_kwargs:
            raise TypeError(f"make_attention_fn: attention_kwargs must not contain {bad!r}")

    def attention_fn(query, key, value, bias=None, mask=None, broadcast_dropout=True,
                     dropout_rng=None, dropout_rate=0.0, deterministic=False, dtype=None,
                     precision=None, module=None, is_causal=False):
        return _attention(
            query, key, value, bias, mask, broadcast_dropout, dropout_rng, dropout_rate,
            deterministic, dtype, precision, module, is_causal, _record=record_max_logit,
            _implementation=implementation, _name=sow_name, _kwargs=attention_kwargs)

    attention_fn.__doc__ = make_attention_fn.__doc__
    return attention_fn


#: Default ``attention_fn``: auto backend, records the max logit when given a module.
attention_fn = make_attention_fn()


def _key_name(entry: Any) -> Any:
    for attr in ("key", "name", "idx"):
        if hasattr(entry, attr):
            return getattr(entry, attr)
    return entry


def normalize_path(path: tuple) -> tuple:
    """A jax key path -> a tuple of plain str/int keys."""
    return tuple(_key_name(e) for e in path)


def collect_max_logits(tree: Any, name: str = SOW_NAME) -> dict[tuple, jax.Array]:
    """Turns sown intermediates into ``{module_path: float32[..., N]}``.

    Args:
      tree: a linen ``intermediates`` collection (with or without the
        ``"intermediates"`` top-level key), an nnx ``State`` of
        ``nnx.Intermediate`` (from ``nnx.capture`` or ``nnx.pop``), any pytree
        whose leaf paths contain ``name``, or an already-collected dict with
        tuple keys (returned as is).
      name: the sown name (default ``"max_logit"``).

    Returns:
      A dict mapping the path of each attention module (the keys before
      ``name``, e.g. ``("blocks", 0, "attn")``) to its per-head max logit. Several
      values sown into the same module (several calls) are reduced with
      ``max``. Leading scan axes are kept: ``[L, N]`` under a layer scan.
    """
    if isinstance(tree, Mapping) and tree and all(isinstance(k, tuple) for k in tree):
        return {k: jnp.asarray(v) for k, v in tree.items()}
    groups: dict[tuple, list] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        p = normalize_path(path)
        if name not in p:
            continue
        idx = len(p) - 1 - p[::-1].index(name)
        prefix = p[:idx]
        if prefix[:1] == ("intermediates",):
            prefix = prefix[1:]
        groups.setdefault(prefix, []).append(jnp.asarray(leaf, jnp.float32))
    return {k: functools.reduce(jnp.maximum, v) for k, v in groups.items()}


def capture_max_logits(fn: Callable, module: Any, *args, **kwargs):
    """Runs ``fn(module, *args, **kwargs)`` on an nnx module, collecting max logits.

    Works across Flax versions: uses ``nnx.capture`` when available, else
    ``nnx.pop(module, nnx.Intermediate)`` after the call. Call it inside your
    jitted loss function. Attention layers must be called with
    ``sow_weights=True`` (or be :class:`maxattn.flax.nnx.DotProductAttention`
    with ``record_max_logit=True``).

    Returns:
      ``(result, max_logits)`` with ``max_logits`` as in
      :func:`collect_max_logits`. Other ``nnx.Intermediate`` values sown
      during the call are dropped.
    """
    from flax import nnx

    if hasattr(nnx, "capture"):
        result, inter = nnx.capture(fn, nnx.Intermediate)(module, *args, **kwargs)
    else:  # pragma: no cover - older Flax
        result = fn(module, *args, **kwargs)
        inter = nnx.pop(module, nnx.Intermediate)
    return result, collect_max_logits(inter)

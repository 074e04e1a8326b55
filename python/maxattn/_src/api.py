"""`maxattn.dot_product_attention`: validation, backend choice, custom VJP."""

from __future__ import annotations

from typing import Literal, Optional, Union

import jax
import jax.numpy as jnp

from maxattn._src import backends, reference, stack
from maxattn._src.call import Call
from maxattn._src.canonicalize import canonicalize, check_implementation
from maxattn._src.cp.spec import max_nan
from maxattn._src.warn import warn_once

Implementation = Literal["cpu", "cudnn", "sm90", "xla"]


def _choose_backend(implementation: Optional[str], call: Call) -> Optional[str]:
    """Returns the backend name, or None for the pure-JAX "xla" path."""
    if implementation == "xla":
        return None
    if implementation is not None:
        reason = backends.unsupported_reason(implementation, call)
        if reason is not None:
            raise ValueError(f'implementation="{implementation}" cannot run this call: {reason}')
        return implementation
    order = backends.auto_order(jax.default_backend(), call.head_dim, call.dense_segments)
    reasons = []
    for name in order:
        reason = backends.unsupported_reason(name, call)
        if reason is None:
            return name
        reasons.append(f'"{name}": {reason}')
    if reasons:
        tried = " and ".join(f'"{n}"' for n in order)
        warn_once(f'maxattn: falling back from {tried} to "xla" (which materialises the T x S logits): '
                  + "; ".join(reasons), stacklevel=4)
    return None


def dot_product_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    bias: Optional[jax.Array] = None,
    mask: Optional[jax.Array] = None,
    *,
    scale: Optional[float] = None,
    is_causal: bool = False,
    causal_alignment: Literal["top_left", "bottom_right"] = "top_left",
    query_seq_lengths: Optional[jax.Array] = None,
    key_value_seq_lengths: Optional[jax.Array] = None,
    q_segment_ids: Optional[jax.Array] = None,
    kv_segment_ids: Optional[jax.Array] = None,
    max_segments_per_row: Optional[int] = None,
    local_window_size: Union[int, tuple[int, int], None] = None,
    logits_soft_cap: Optional[float] = None,
    dropout_rate: float = 0.0,
    dropout_rng: Optional[jax.Array] = None,
    softmax_type: Literal["vanilla", "off_by_one", "learnable"] = "vanilla",
    sink_logits: Optional[jax.Array] = None,
    implementation: Optional[Implementation] = None,
    return_max_logit: bool = False,
    return_lse: bool = False,
    return_residual: bool = False,
    context_parallel: Optional[Literal["all_gather", "ring"]] = None,
    context_parallel_axis: Optional[str] = None,
    load_balanced: bool = False,
    deterministic_backward: bool = False,
) -> Union[jax.Array, tuple[jax.Array, dict[str, jax.Array]]]:
    """Scaled dot-product attention that can also return the per-head max logit and the LSE.

    Computes ``softmax(cap(scale * q @ k^T + bias), masked) @ v`` per head, with
    the arguments and meanings of ``jax.nn.dot_product_attention`` (layout BTNH).

    Like jax.nn, every array may also come without its batch axis: ``query``
    [T, N, H], ``key`` [S, K, H], ``value`` [S, K, Hv] (all three, or none);
    bias/mask broadcastable to [N, T, S]; sequence lengths of shape [] or [1];
    segment ids [T] / [S]. Results then have no batch axis either.

    Args:
      query: [B, T, N, H] float32, bfloat16 or float16.
      key: [B, S, K, H], same dtype; N must be a multiple of K (GQA/MQA:
        query head n uses kv head n // (N // K)).
      value: [B, S, K, Hv], same dtype.
      bias: additive bias applied after scaling, broadcastable to [B, N, T, S].
        Differentiable. The "cudnn" backend consumes it in the input dtype
        (bf16/fp16), as cuDNN does; pass it in that dtype to get exactly the
        logits (and max_logit) it computes.
      mask: boolean, broadcastable to [B, N, T, S]; True means attend. The
        "cudnn" backend folds it (and segment ids, unless
        ``max_segments_per_row`` is given) into a [B', N', T, S] bias, so it
        costs O(T * S) memory and bandwidth there.
      scale: logit scale; default 1/sqrt(H). A Python number or a concrete
        JAX/NumPy scalar; the kernels compile it in, so a traced scale (a jit
        argument) raises TypeError -- make it static, or scale ``query``.
      is_causal: causal mask.
      causal_alignment: "top_left" (key j visible to query i iff j <= i) or
        "bottom_right" (iff j <= i + kv_len - q_len, with the valid lengths
        when sequence lengths are given). Also sets the diagonal of the window.
      query_seq_lengths: int [B]; queries at positions >= the length are padding.
        Lengths are traced values, so they are not checked: a length below 0
        acts as 0 and one above T as T (every backend).
      key_value_seq_lengths: int [B]; keys at positions >= the length are padding
        (clamped to [0, S] likewise).
      q_segment_ids: int [B, T]; packed sequences, a query attends only keys of
        the same segment; id 0 marks padding. Requires ``kv_segment_ids`` [B, S].
      kv_segment_ids: int [B, S].
      max_segments_per_row: a static int M in [1, 1024], with segment ids: a
        promise that every row is at most M contiguous segments (a row like
        1,1,2,2,1 is not), that queries and keys list the same segments in the
        same order, and -- with a causal mask or window -- that each query
        segment starts where its key segment does (shifted by S - T with
        bottom-right alignment, using the valid lengths). "cudnn" then runs
        the segments as ragged sequences (cuDNN's padded/ragged layout: O(B *
        T) extra memory, cross-segment work skipped) instead of folding the
        ids into a dense [B, 1, T, S] bias (O(T * S) memory and time, and a
        one-time warning saying so). The promise is checked on the device,
        per row: a row that breaks it comes out NaN there (out, lse, and so
        max_logit; zero gradients) -- never silently wrong. Other backends,
        and cudnn calls with a bias, mask, dropout or sinks (which keep the
        dense path), ignore the bound and compute the exact segment-id rule.
      local_window_size: int w (= (w, w)) or (left, right): query i sees keys
        in [i - left, i + right] (shifted by the alignment's diagonal). Any
        non-negative int; bounds of T + S or more are unbounded.
      logits_soft_cap: c > 0: logits -> c * tanh(logits / c) before softmax.
      dropout_rate: attention dropout in [0, 1) (ValueError otherwise). Acts on
        the normalised probabilities: p' = p * keep / (1 - rate), out = p' @ v;
        lse and max_logit are unaffected. On "cpu" and "xla", keep(b, n, i, j)
        is a counter-based Philox4x32-10 hash of (dropout_rng, b, n, i, j)
        (csrc/maxattn/dropout.h, identical in both), so a key gives
        reproducible results and the backward reuses the forward's mask.
        "cudnn" uses cuDNN's own Philox dropout seeded from the same key: also
        reproducible and shared by forward and backward, but a different mask.
        0.0 is bit-identical to no dropout (dropout_rng is then ignored).
        Under ``jit`` with sharded batch/heads each shard draws its part of the
        same global mask ("cudnn": an independent mask per shard, reproducible
        for a key and mesh). Under ``vmap`` with an unbatched key the "cpu" backend
        and "cudnn" backends fold the mapped axes into the batch, so every mapped
        instance gets an independent mask; the "xla" backend (plain JAX vmap semantics) gives
        every instance the same mask. With a batched (vmapped) key each instance
        uses its own key (the fused backends then run the instances one after
        another with ``lax.map``). Under ``context_parallel`` every (query
        block, key block) kernel call draws an independent mask (the key mixed
        with the block's position): reproducible for a key, mesh and CP
        configuration, but not the unsharded call's mask.
      dropout_rng: a JAX PRNG key (``jax.random.key`` or a raw uint32[2]
        ``PRNGKey``); required when ``dropout_rate > 0``.
      softmax_type: "vanilla"; "off_by_one" (adds 1 = exp(0) to every softmax
        denominator); or "learnable" (adds exp(sink_logits[n]): gpt-oss style
        attention sinks). The sink logit is neither scaled nor soft-capped.
        ``aux["lse"]`` includes the sink term, ``aux["max_logit"]`` excludes it.
        A row with no visible key has output 0 and lse = the sink logit
        (finite; 0 for off_by_one). Under ``context_parallel`` the sink is
        applied once per query row after the blocks are merged (same results).
      sink_logits: float32 [N], one sink logit per query head; required iff
        ``softmax_type="learnable"``. Differentiable.
      implementation: None (auto: the platform's fused backend when it can run
        the call -- "cpu" on a CPU; on a GPU "cudnn", else "sm90" (on Hopper,
        e.g. for a soft cap) -- else "xla" with a one-time warning naming the
        reasons),
        "cpu" (C++ kernels), "cudnn" (GPU), "sm90" (our Hopper kernels:
        in-kernel max_logit, soft cap, segment ids (without
        max_segments_per_row) and sinks; our backward at head dims 64 and
        128, cuDNN's at 256 (the reference's with a soft cap there); no
        bias, mask or dropout) or "xla" (pure JAX reference). An explicitly
        requested backend that cannot run the call raises ValueError with the
        reason.
      return_max_logit: also return ``aux["max_logit"]``.
      return_lse: also return ``aux["lse"]``.
      return_residual: jax.nn's spelling: return ``(out, residual)`` where the
        residual is the log-sum-exp as [B, T, N] ([T, N] unbatched) in the
        input dtype, without gradient -- exactly what jax.nn returns. Not
        combinable with ``return_max_logit`` / ``return_lse`` (use those for
        the float32 [B, N, T] lse, which is differentiable).
      context_parallel: None, "all_gather" or "ring": shard attention over the
        sequence (context parallelism) along mesh axis ``context_parallel_axis``
        under ``jit``. "all_gather" gathers K/V over that axis (and
        reduce-scatters dK/dV); "ring" rotates K/V blocks with ppermute and
        merges partial results through the lse. Supports no mask or causal
        (top-left, T == S), padding lengths, segment ids, dropout and sinks;
        not bias, mask, local window or bottom-right alignment (ValueError).
        query/key/value should be sharded over the axis on their sequence
        dimension.
      context_parallel_axis: the mesh axis name that shards the sequence.
      load_balanced: the sequence of query/key/value (and segment ids) was
        permuted with ``maxattn.reorder_for_load_balancing(x, cp_size, axis=1)``
        (cp_size = size of the cp axis); the outputs (out, lse) are in that same
        permuted order (undo with ``inverse_reorder_for_load_balancing``).
      deterministic_backward: the gradients (dq, dk, dv, dsink) come out
        bit-identical on every run with the same inputs. "sm90" then adds each
        query block's dQ tiles in a fixed order (CTAs wait for their turn: the
        backward takes 1.13-1.54x its time on an H200); "cudnn" uses cuDNN's
        deterministic backward algorithm (a [B, N, T, S] workspace on Hopper).
        "cpu" and "xla" are deterministic anyway. Without it, dk, dv and dsink
        are bit-stable on every backend and dq on "sm90" and "cudnn" may differ
        in its last bits between runs (float additions in arrival order).

    Returns:
      ``out`` [B, T, N, Hv] in the input dtype when no return flag is set;
      ``(out, residual)`` with ``return_residual``; otherwise ``(out, aux)``
      with the requested keys:

      * ``aux["max_logit"]``: float32 [N]. For each query head n, the maximum of
        ``scale * <q, k> + bias`` over every batch row and every visible
        (query, key) pair -- before the soft cap, excluding masked entries;
        -inf for a head with nothing visible; NaN if a visible logit is NaN.
        Under vmap the mapped axes come first. No gradient flows through it
        (its cotangent is ignored).
      * ``aux["lse"]``: float32 [B, N, T], natural-log log-sum-exp of the
        (capped) visible logits of each query row; -inf for a fully masked row
        (whose output is 0). Differentiable.

    Raises:
      ValueError / TypeError at trace time for invalid arguments, naming the
      argument and the rule.

    Autodiff: reverse mode (``grad``, ``vjp``, ``jacrev``) on every backend.
    The fused backends ("cpu", "cudnn", and any call with context
    parallelism) have a custom VJP, so forward mode (``jvp``, ``jacfwd``)
    raises JAX's TypeError "can't apply forward-mode autodiff (jvp) to a
    custom_vjp function" and second order (grad of grad, ``hessian``) raises
    NotImplementedError saying so; ``implementation="xla"`` (without context
    parallelism) is plain JAX and supports every mode.
    """
    check_implementation(implementation)
    if not isinstance(return_residual, bool):
        raise TypeError(f"`return_residual` must be a Python bool, got {type(return_residual).__name__}")
    if return_residual and (return_max_logit is True or return_lse is True):
        raise ValueError("`return_residual` (jax.nn's lse as [B, T, N] in the input dtype) cannot be combined "
                         "with `return_max_logit` / `return_lse`; use return_lse=True for the float32 "
                         "[B, N, T] lse next to the max logit")
    call, cp, unbatched = canonicalize(
        query, key, value, bias, mask, scale=scale, is_causal=is_causal,
        causal_alignment=causal_alignment, query_seq_lengths=query_seq_lengths,
        key_value_seq_lengths=key_value_seq_lengths, q_segment_ids=q_segment_ids,
        kv_segment_ids=kv_segment_ids, max_segments_per_row=max_segments_per_row,
        local_window_size=local_window_size,
        logits_soft_cap=logits_soft_cap, dropout_rate=dropout_rate, dropout_rng=dropout_rng,
        softmax_type=softmax_type, sink_logits=sink_logits, return_max_logit=return_max_logit,
        return_lse=True if return_residual else return_lse, context_parallel=context_parallel,
        context_parallel_axis=context_parallel_axis, load_balanced=load_balanced,
        deterministic_backward=deterministic_backward)
    backend = _choose_backend(implementation, call)

    if backend is None and cp is None:
        out, lse, mx = reference.attention(call)
        lse = lse.astype(jnp.float32) if lse.dtype != jnp.float64 else lse
    else:
        out, lse, mx = stack.fused(backend or "xla", cp)(call)

    options = call.options
    if unbatched:
        out, lse = out[0], (None if lse is None else lse[0])
    if return_residual:
        residual = jnp.swapaxes(lse, -1, -2).astype(out.dtype)  # [.., N, T] -> [.., T, N]
        return out, jax.lax.stop_gradient(residual)
    if not (options.max_logit or options.lse):
        return out
    aux: dict[str, jax.Array] = {}
    if options.max_logit:
        if mx.shape[0] == 1:  # reduced over the batch already (options.max_logit_over_batch): no XLA kernel
            batch_max = mx[0]
        else:  # per batch row (the reference path)
            batch_max = max_nan(mx, axis=0)
        aux["max_logit"] = jax.lax.stop_gradient(batch_max.astype(jnp.float32))
    if options.lse:
        aux["lse"] = lse
    return out, aux


def reference_attention(query, key, value, bias=None, mask=None, **kwargs):
    """``dot_product_attention(..., implementation="xla")``: the pure-JAX oracle.

    Materialises the [B, N, T, S] logits. Accepts float64 inputs (with
    ``jax_enable_x64``), computing in float64; the test-suite uses it that way.
    """
    kwargs["implementation"] = "xla"
    return dot_product_attention(query, key, value, bias, mask, **kwargs)

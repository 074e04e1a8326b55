"""The GPU backends (cudnn, and sm90 where it runs the case) against the float64 reference.

Skipped (not passed) without a GPU: run on the device machine with
tools/gpu_check.sh. Tolerances are docs/contract.md's ("Tolerances the tests use").
"""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import maxattn
from helpers import (GPU_MARKS, bias_and_cotangents, MAX_TOL, OUT_TOL, assert_close, assert_max_logit_close,
                     loss_and_grads, random_inputs, reference64)


pytestmark = GPU_MARKS

# name: (B, T, S, N, K, H, Hv, dtype, kwargs builder, bias shape or None)
CASES = {
    "plain": (2, 128, 128, 4, 4, 64, 64, jnp.bfloat16, {}, None),
    "causal_gqa": (2, 128, 128, 4, 2, 64, 64, jnp.bfloat16, {"is_causal": True}, None),
    "causal_bottom_right": (2, 64, 160, 4, 4, 64, 64, jnp.bfloat16,
                            {"is_causal": True, "causal_alignment": "bottom_right"}, None),
    "padding_causal": (2, 128, 128, 4, 4, 64, 64, jnp.bfloat16,
                       {"is_causal": True, "query_seq_lengths": [100, 37],
                        "key_value_seq_lengths": [128, 53]}, None),
    "padding_bottom_right": (2, 96, 128, 4, 2, 64, 64, jnp.bfloat16,
                             {"is_causal": True, "causal_alignment": "bottom_right",
                              "query_seq_lengths": [96, 20], "key_value_seq_lengths": [128, 70]}, None),
    "padding_q_only": (2, 128, 128, 4, 4, 64, 64, jnp.bfloat16, {"query_seq_lengths": [128, 9]}, None),
    "bias_1NTS": (2, 128, 128, 4, 4, 64, 64, jnp.bfloat16, {}, "1NTS"),
    "bias_BNTS_causal": (2, 128, 128, 4, 2, 64, 64, jnp.bfloat16, {"is_causal": True}, "BNTS"),
    "bias_B11S_padding": (2, 128, 128, 4, 4, 64, 64, jnp.bfloat16,
                          {"query_seq_lengths": [128, 64], "key_value_seq_lengths": [90, 128]}, "B11S"),
    "window": (2, 128, 128, 4, 4, 64, 64, jnp.bfloat16, {"local_window_size": (16, 8)}, None),
    "window_causal": (2, 128, 128, 4, 4, 64, 64, jnp.bfloat16, {"is_causal": True, "local_window_size": (24, 0)},
                      None),
    "mqa_h128_hv64": (2, 128, 192, 8, 1, 128, 64, jnp.bfloat16, {}, None),
    "fp16_causal": (2, 128, 128, 4, 2, 64, 64, jnp.float16, {"is_causal": True}, None),
    "fp16_bias_padding": (2, 128, 128, 4, 4, 128, 128, jnp.float16,
                          {"query_seq_lengths": [77, 128], "key_value_seq_lengths": [128, 101]}, "1NTS"),
    "h256_causal_gqa_padding": (2, 200, 200, 4, 2, 256, 256, jnp.bfloat16,
                                {"is_causal": True, "query_seq_lengths": [200, 77],
                                 "key_value_seq_lengths": [200, 130]}, None),
}


def _inputs(name, seed=0):
    B, T, S, N, K, H, Hv, dtype, kwargs, bias_shape = CASES[name]
    q, k, v = random_inputs(seed, B, T, S, N, K, H, Hv, dtype)
    rng = np.random.default_rng(seed + 7)
    kwargs = {key: (jnp.asarray(val, jnp.int32) if "seq_lengths" in key else val) for key, val in kwargs.items()}
    bias, ct_out, ct_lse = bias_and_cotangents(rng, B, T, S, N, Hv, bias_shape, dtype)
    return q, k, v, bias, ct_out, ct_lse, kwargs


def _cudnn(q, k, v, bias, **kwargs):
    return maxattn.dot_product_attention(q, k, v, bias, implementation="cudnn", **kwargs)


# The sm90 backend (our Hopper forward and backward) runs
# the cases without a bias whose head dims are equal and 64, 128 or 256 -- decided here from the
# case, so no case is skipped.
BACKENDS = ("cudnn", "sm90")


def _sm90_runs(name):
    _, _, _, _, _, H, Hv, _, _, bias_shape = CASES[name]
    return bias_shape is None and H == Hv and H in (64, 128, 256)


def _by_backend(names):
    return [pytest.param(impl, n, id=f"{impl}-{n}") for impl in BACKENDS for n in names
            if impl == "cudnn" or _sm90_runs(n)]


def _attention(impl):
    return lambda q, k, v, bias, **kw: maxattn.dot_product_attention(q, k, v, bias, implementation=impl, **kw)


@pytest.mark.parametrize("impl, name", _by_backend(CASES))
def test_forward_backward_matches_reference(impl, name):
    q, k, v, bias, ct_out, ct_lse, kwargs = _inputs(name)
    dtype = q.dtype.type
    out, aux, grads = jax.jit(lambda *a: loss_and_grads(_attention(impl), *a, **kwargs))(q, k, v, bias, ct_out,
                                                                                      ct_lse)
    r_out, r_aux, r_grads = reference64(q, k, v, bias, ct_out, ct_lse, **kwargs)
    assert out.dtype == q.dtype and aux["lse"].dtype == jnp.float32 and aux["max_logit"].dtype == jnp.float32
    assert_close(out, r_out, OUT_TOL[dtype], "out")
    assert_close(aux["lse"], r_aux["lse"], OUT_TOL[dtype], "lse")
    assert_max_logit_close(aux["max_logit"], r_aux["max_logit"], MAX_TOL[dtype])
    for g, rg, what in zip(grads, r_grads, ("dq", "dk", "dv", "dbias")):
        assert g.shape == rg.shape, what
        assert_close(g, rg, OUT_TOL[dtype], what)


@pytest.mark.parametrize("name", ["plain", "padding_causal", "bias_1NTS", "bias_B11S_padding", "mqa_h128_hv64"])
def test_grads_without_lse_cotangent(name):
    """Gradients of <out, ct> alone: the backward without the folded lse column."""
    q, k, v, bias, ct_out, _, kwargs = _inputs(name, seed=21)
    argnums = (0, 1, 2, 3) if bias is not None else (0, 1, 2)

    def loss(q, k, v, bias):
        return jnp.sum(_cudnn(q, k, v, bias, **kwargs).astype(jnp.float32) * ct_out)

    grads = jax.jit(jax.grad(loss, argnums=argnums))(q, k, v, bias)
    _, _, r_grads = reference64(q, k, v, bias, ct_out, jnp.zeros(ct_out.shape[:1] + (q.shape[2], q.shape[1])),
                                **kwargs)
    for g, rg, what in zip(grads, r_grads, ("dq", "dk", "dv", "dbias")):
        assert_close(g, rg, OUT_TOL[q.dtype.type], what)


@pytest.mark.parametrize("impl, name", _by_backend(["plain", "causal_gqa", "padding_causal", "bias_1NTS"]))
@pytest.mark.parametrize("flags", [(False, False), (True, False), (False, True)])
def test_forward_output_subsets(impl, name, flags):
    """Calls asking for less (plain graph, max only, lse only) agree with the full call."""
    want_max, want_lse = flags
    q, k, v, bias, _, _, kwargs = _inputs(name, seed=3)
    run = _attention(impl)
    full_out, full_aux = run(q, k, v, bias, return_max_logit=True, return_lse=True, **kwargs)
    res = run(q, k, v, bias, return_max_logit=want_max, return_lse=want_lse, **kwargs)
    out, aux = (res, {}) if not (want_max or want_lse) else res
    assert_close(out, full_out, 1e-2, "out")  # another graph may pick another engine
    assert set(aux) == ({"max_logit"} if want_max else set()) | ({"lse"} if want_lse else set())
    for key, val in aux.items():
        np.testing.assert_allclose(np.asarray(val), np.asarray(full_aux[key]), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("impl", BACKENDS)
def test_max_logit_spike_in_one_batch_row(impl):
    """A logit spike in batch row 1 only: a missing reduction over the batch cannot pass."""
    B, T, S, N, K, H = 3, 256, 256, 8, 8, 64
    q, k, v = random_inputs(11, B, T, S, N, K, H, H, jnp.bfloat16)
    q = q.at[1, 200, 5].set(jnp.asarray(np.full(H, 4.0), jnp.bfloat16))
    k = k.at[1, 17, 5].set(jnp.asarray(np.full(H, 4.0), jnp.bfloat16))
    _, aux = _attention(impl)(q, k, v, None, is_causal=True, return_max_logit=True)
    _, r_aux, _ = reference64(q, k, v, None, jnp.zeros((B, T, N, H)), jnp.zeros((B, N, T)), is_causal=True)
    assert float(aux["max_logit"][5]) == pytest.approx(128.0, rel=1e-3)
    assert_max_logit_close(aux["max_logit"], r_aux["max_logit"], MAX_TOL[jnp.bfloat16])


@pytest.mark.parametrize("impl", BACKENDS)
def test_fully_padded_rows_give_zero_and_neg_inf(impl):
    q, k, v, _, _, _, _ = _inputs("plain", seed=5)
    kwargs = dict(query_seq_lengths=jnp.asarray([128, 128], jnp.int32),
                  key_value_seq_lengths=jnp.asarray([0, 64], jnp.int32))
    out, aux = _attention(impl)(q, k, v, None, return_max_logit=True, return_lse=True, **kwargs)
    assert np.all(np.asarray(out[0], np.float32) == 0)
    assert np.all(np.isneginf(np.asarray(aux["lse"][0])))
    assert np.all(np.isfinite(np.asarray(out[1], np.float32)))
    r_out, r_aux, _ = reference64(q, k, v, None, jnp.zeros(out.shape), jnp.zeros(aux["lse"].shape), **kwargs)
    assert_close(out, r_out, OUT_TOL[jnp.bfloat16], "out")
    assert_max_logit_close(aux["max_logit"], r_aux["max_logit"], MAX_TOL[jnp.bfloat16])


def test_vmap_gives_each_instance_its_own_max():
    q, k, v, _, _, _, _ = _inputs("causal_gqa", seed=9)
    qs = jnp.stack([q, q * 2, q * 0.5])

    def f(qq):
        return _cudnn(qq, k, v, None, is_causal=True, return_max_logit=True)

    outs, aux = jax.vmap(f)(qs)
    assert aux["max_logit"].shape == (3, q.shape[2])
    for i in range(3):
        o_i, a_i = f(qs[i])
        np.testing.assert_array_equal(np.asarray(outs[i], np.float32), np.asarray(o_i, np.float32))
        np.testing.assert_allclose(np.asarray(aux["max_logit"][i]), np.asarray(a_i["max_logit"]), rtol=1e-6)


def test_jit_compiles_once_and_grad_through_out_only():
    q, k, v, _, _, _, _ = _inputs("causal_gqa", seed=13)
    traces = []

    def loss(q, k, v):
        traces.append(1)
        return jnp.sum(_cudnn(q, k, v, None, is_causal=True).astype(jnp.float32) ** 2)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    g1 = grad(q, k, v)
    g2 = grad(q, k, v)
    assert len(traces) == 1
    for a, b in zip(g1, g2):
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))

    def ref_loss(q, k, v):
        return jnp.sum(maxattn.reference(q, k, v, is_causal=True).astype(jnp.float32) ** 2)

    r = jax.grad(ref_loss, argnums=(0, 1, 2))(*(x.astype(jnp.float32) for x in (q, k, v)))
    for a, b, what in zip(g1, r, ("dq", "dk", "dv")):
        assert_close(a, b, OUT_TOL[jnp.bfloat16], what)


@pytest.mark.parametrize("kwargs, dtype, needle", [
    ({}, jnp.float32, "float32"),
    ({"logits_soft_cap": 30.0}, jnp.bfloat16, "not supported"),
    ({"logits_soft_cap": 30.0, "is_causal": True}, jnp.bfloat16, "known cuDNN gap"),
    ({"is_causal": True, "causal_alignment": "bottom_right", "query_seq_lengths": [40],
      "key_value_seq_lengths": [64], "dropout_rate": 0.1}, jnp.bfloat16, "dropout together with bottom-right"),
])
def test_unsupported_configurations_raise_with_reason(kwargs, dtype, needle):
    q, k, v = random_inputs(1, 1, 64, 64, 2, 2, 64, 64, dtype)
    kwargs = {key: (jnp.asarray(val, jnp.int32) if "seq_lengths" in key else val) for key, val in kwargs.items()}
    if "dropout_rate" in kwargs:
        kwargs["dropout_rng"] = jax.random.key(0)
    with pytest.raises(ValueError, match=needle):
        maxattn.dot_product_attention(q, k, v, implementation="cudnn", **kwargs)


def test_auto_prefers_sm90_at_head_dims_128_and_256_then_cudnn_and_falls_back_with_warning():
    q, k, v = random_inputs(2, 1, 64, 64, 2, 2, 128, 128, jnp.bfloat16)
    # A soft cap (no cuDNN) with a bias (not on sm90): neither fused GPU backend runs it, and the
    # one warning names both refusals.
    bias = jnp.zeros((1, 2, 64, 64), jnp.bfloat16)
    with pytest.warns(RuntimeWarning, match='falling back from "sm90" and "cudnn" to "xla".*"sm90": .*bias'):
        maxattn.dot_product_attention(q, k, v, bias, is_causal=True, logits_soft_cap=20.0)
    # What both run goes to sm90 at head dim 128, bit for bit the explicit call; a bias (sm90 refuses
    # it) goes to cuDNN.
    out = maxattn.dot_product_attention(q, k, v, is_causal=True)
    ref = maxattn.dot_product_attention(q, k, v, is_causal=True, implementation="sm90")
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ref, np.float32))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback to xla would warn
        out = maxattn.dot_product_attention(q, k, v, bias, is_causal=True)
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(_cudnn(q, k, v, bias, is_causal=True),
                                                                          np.float32))
    # Head dim 64: cuDNN first, sm90 for segment ids (cuDNN would fold them into a dense bias).
    q, k, v = random_inputs(3, 1, 64, 64, 2, 2, 64, 64, jnp.bfloat16)
    seg = jnp.asarray([[1] * 40 + [2] * 24], jnp.int32)
    lower = lambda **kw: jax.jit(lambda q, k, v: maxattn.dot_product_attention(q, k, v, **kw)).lower(q, k, v).as_text()
    hlo = lower()
    assert "maxattn_attention_fwd_cuda" in hlo and "maxattn_attention_fwd_sm90" not in hlo
    hlo = lower(q_segment_ids=seg, kv_segment_ids=seg)
    assert "maxattn_attention_fwd_sm90" in hlo and "maxattn_attention_fwd_cuda" not in hlo
    # Head dim 256: sm90 first (its forward + backward outruns cuDNN's), with its own backward.
    q, k, v = random_inputs(4, 1, 64, 64, 2, 2, 256, 256, jnp.bfloat16)
    loss = lambda q, k, v: jnp.sum(maxattn.dot_product_attention(q, k, v, is_causal=True).astype(jnp.float32))
    hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).as_text()
    assert "maxattn_attention_fwd_sm90" in hlo and "maxattn_attention_bwd_sm90" in hlo
    assert "maxattn_attention_fwd_cuda" not in hlo and "maxattn_attention_bwd_cuda" not in hlo


@pytest.mark.parametrize("kwargs, needle", [
    ({"dropout_rate": 0.1}, "dropout is not supported"),
    ({"bias": True}, "bias is not supported"),
])
def test_sm90_names_what_it_cannot_run(kwargs, needle):
    q, k, v = random_inputs(1, 1, 64, 64, 2, 2, 64, 64, jnp.bfloat16)
    kwargs = dict(kwargs)
    bias = jnp.zeros((1, 2, 64, 64), jnp.bfloat16) if kwargs.pop("bias", False) else None
    if "dropout_rate" in kwargs:
        kwargs["dropout_rng"] = jax.random.key(0)
    with pytest.raises(ValueError, match=f'implementation="sm90" cannot run this call: .*{needle}'):
        maxattn.dot_product_attention(q, k, v, bias, implementation="sm90", **kwargs)
    # Auto mode: cuDNN for what sm90 refuses, also at head dim 128 where sm90 comes first.
    q, k, v = random_inputs(1, 1, 64, 64, 2, 2, 128, 128, jnp.bfloat16)
    auto = jax.jit(lambda q, k, v, bias: maxattn.dot_product_attention(q, k, v, bias, **kwargs))
    hlo = auto.lower(q, k, v, bias).as_text()
    assert "maxattn_attention_fwd_cuda" in hlo and "maxattn_attention_fwd_sm90" not in hlo
    hlo = jax.jit(lambda q, k, v: maxattn.dot_product_attention(q, k, v)).lower(q, k, v).as_text()
    assert "maxattn_attention_fwd_sm90" in hlo and "maxattn_attention_fwd_cuda" not in hlo


def test_auto_mode_runs_soft_cap_on_sm90():
    """A soft cap, which cuDNN refuses, runs on the sm90 kernel in auto mode (no "xla" fallback)."""
    q, k, v = random_inputs(2, 1, 128, 128, 2, 2, 128, 128, jnp.bfloat16)
    f = lambda q, k, v: maxattn.dot_product_attention(q, k, v, logits_soft_cap=20.0, is_causal=True)
    hlo = jax.jit(f).lower(q, k, v).as_text()
    assert "maxattn_attention_fwd_sm90" in hlo
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fallback to xla would warn
        out = jax.jit(f)(q, k, v)
    r_out, _, _ = reference64(q, k, v, None, jnp.zeros_like(q), jnp.zeros((1, 2, 128), jnp.float32),
                              logits_soft_cap=20.0, is_causal=True)
    assert_close(out, r_out, OUT_TOL[jnp.bfloat16], "out")


# Soft-capped calls on sm90: the kernels' tanh softmax forward and the backward's gradient through
# tanh, at every head dim (cuDNN has no soft cap). q is scaled up so that the raw logits (std ~4, max
# ~15) are bent by the cap of 10.
SOFTCAP_CASES = {
    "h64_causal_gqa": (2, 256, 256, 4, 2, 64, jnp.bfloat16, {"is_causal": True}),
    "h128_odd_padding_br": (2, 300, 333, 4, 4, 128, jnp.bfloat16,
                            {"is_causal": True, "causal_alignment": "bottom_right",
                             "query_seq_lengths": [300, 41], "key_value_seq_lengths": [333, 90]}),
    "h128_window": (1, 257, 257, 2, 2, 128, jnp.float16, {"local_window_size": (40, 8)}),
    "h256_dense": (1, 130, 200, 2, 1, 256, jnp.bfloat16, {}),
}


@pytest.mark.parametrize("name", list(SOFTCAP_CASES))
def test_sm90_soft_cap_matches_reference(name):
    B, T, S, N, K, H, dtype, kwargs = SOFTCAP_CASES[name]
    q, k, v = random_inputs(31, B, T, S, N, K, H, H, dtype)
    q = (q.astype(jnp.float32) * 4).astype(dtype)
    kwargs = {key: (jnp.asarray(val, jnp.int32) if "seq_lengths" in key else val) for key, val in kwargs.items()}
    kwargs["logits_soft_cap"] = 10.0
    _, ct_out, ct_lse = bias_and_cotangents(np.random.default_rng(5), B, T, S, N, H, None, dtype)
    out, aux, grads = jax.jit(lambda *a: loss_and_grads(_attention("sm90"), *a, **kwargs))(q, k, v, None, ct_out,
                                                                                        ct_lse)
    r_out, r_aux, r_grads = reference64(q, k, v, None, ct_out, ct_lse, **kwargs)
    tol = OUT_TOL[dtype]
    assert_close(out, r_out, tol, "out")
    assert_close(aux["lse"], r_aux["lse"], tol, "lse")
    # max_logit is the pre-cap maximum: far above the cap here.
    assert float(np.nanmax(np.asarray(r_aux["max_logit"]))) > 10.0
    assert_max_logit_close(aux["max_logit"], r_aux["max_logit"], MAX_TOL[dtype])
    for g, rg, what in zip(grads, r_grads, ("dq", "dk", "dv")):
        assert_close(g, rg, tol, what)


def test_sm90_max_logit_with_odd_lengths():
    """max_logit from the sm90 kernel's per-warp atomics at T = 300 (not a tile multiple), next to cuDNN's."""
    B, T, N, K, H = 2, 300, 4, 2, 128
    q, k, v = random_inputs(12, B, T, T, N, K, H, H, jnp.bfloat16)
    a = maxattn.dot_product_attention(q, k, v, is_causal=True, implementation="sm90", return_max_logit=True)[1]
    b = maxattn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn", return_max_logit=True)[1]
    _, r, _ = reference64(q, k, v, None, jnp.zeros((B, T, N, H)), jnp.zeros((B, N, T)), is_causal=True)
    assert_max_logit_close(a["max_logit"], r["max_logit"], MAX_TOL[jnp.bfloat16])
    assert_max_logit_close(b["max_logit"], r["max_logit"], MAX_TOL[jnp.bfloat16])


# Which backward an sm90 call compiles to: ours at every head dim, in both modes.
@pytest.mark.parametrize("H, deterministic, target", [(64, False, "maxattn_attention_bwd_sm90"),
                                                      (128, True, "maxattn_attention_bwd_sm90"),
                                                      (256, False, "maxattn_attention_bwd_sm90"),
                                                      (256, True, "maxattn_attention_bwd_sm90")])
def test_sm90_backward_target(H, deterministic, target):
    q, k, v = random_inputs(3, 1, 128, 128, 2, 2, H, H, jnp.bfloat16)
    loss = lambda q, k, v: jnp.sum(maxattn.dot_product_attention(
        q, k, v, is_causal=True, implementation="sm90", deterministic_backward=deterministic).astype(jnp.float32))
    hlo = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).as_text()
    assert target in hlo
    other = {"maxattn_attention_bwd_sm90", "maxattn_attention_bwd_cuda"} - {target}
    assert other.pop() not in hlo


def test_sm90_backward_repeats():
    """Two runs of the sm90 backward: dk and dv bit-identical (summed in registers in a fixed
    order); dq, summed over key blocks by float atomics, equal up to the order of those sums."""
    q, k, v = random_inputs(8, 2, 384, 384, 8, 2, 128, 128, jnp.bfloat16)
    ct = jnp.asarray(np.random.default_rng(8).standard_normal(q.shape), jnp.float32)
    loss = lambda q, k, v: jnp.sum(maxattn.dot_product_attention(q, k, v, is_causal=True, implementation="sm90")
                                   .astype(jnp.float32) * ct)
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    (dq1, dk1, dv1), (dq2, dk2, dv2) = grad(q, k, v), grad(q, k, v)
    np.testing.assert_array_equal(np.asarray(dk1, np.float32), np.asarray(dk2, np.float32))
    np.testing.assert_array_equal(np.asarray(dv1, np.float32), np.asarray(dv2, np.float32))
    assert_close(dq1, np.asarray(dq2, np.float32), 1e-2, "dq")


# deterministic_backward=True: every gradient bit-identical across runs. sm90 orders its dQ adds
# (CTAs in turn per query block); cudnn uses cuDNN's deterministic algorithm. Cases with many key
# blocks per query block (the adds that can race), GQA, padding, segment ids and sinks.
DETERMINISTIC_CASES = {
    "dense_gqa": (2, 1024, 1024, 8, 2, 128, {}),
    "causal_padding_h64": (3, 700, 900, 4, 4, 64, dict(is_causal=True, causal_alignment="bottom_right",
                                                        query_seq_lengths=np.array([700, 333, 1], np.int32),
                                                        key_value_seq_lengths=np.array([900, 512, 600], np.int32))),
    "segments_window": (2, 1000, 1000, 4, 2, 128, dict(local_window_size=(300, 0), q_segment_ids="runs",
                                                        kv_segment_ids="runs")),
    "sinks_causal": (2, 640, 640, 4, 2, 128, dict(is_causal=True, softmax_type="learnable",
                                                   sink_logits=np.array([0.5, -1.0, 2.0, 0.0], np.float32))),
    "padding_gqa_h256": (2, 700, 700, 4, 2, 256, dict(query_seq_lengths=np.array([700, 333], np.int32),
                                                        key_value_seq_lengths=np.array([650, 700], np.int32))),
}


def _deterministic_case(name):
    B, T, S, N, K, H, kwargs = DETERMINISTIC_CASES[name]
    q, k, v = random_inputs(31, B, T, S, N, K, H, H, jnp.bfloat16)
    rng = np.random.default_rng(32)
    kwargs = dict(kwargs)
    if kwargs.get("q_segment_ids") == "runs":  # unequal runs, a padding run (id 0) in row 1
        ids = np.zeros((B, T), np.int32)
        ids[0] = np.repeat([1, 2, 3, 4], [130, 470, 1, 399])
        ids[1] = np.repeat([0, 5, 6], [100, 650, 250])
        kwargs["q_segment_ids"] = kwargs["kv_segment_ids"] = jnp.asarray(ids)
    ct_out = jnp.asarray(rng.standard_normal(q.shape[:3] + (H,)), jnp.float32)
    ct_lse = jnp.asarray(rng.standard_normal((B, N, T)), jnp.float32)
    return q, k, v, ct_out, ct_lse, kwargs


@pytest.mark.parametrize("impl", BACKENDS)
@pytest.mark.parametrize("name", DETERMINISTIC_CASES)
def test_deterministic_backward_is_bit_identical(impl, name):
    q, k, v, ct_out, ct_lse, kwargs = _deterministic_case(name)
    if impl == "cudnn" and "q_segment_ids" in kwargs:
        kwargs["max_segments_per_row"] = 4  # cuDNN's ragged path (the dense-bias one is covered elsewhere)
    run = jax.jit(lambda q, k, v, ct_out, ct_lse: loss_and_grads(
        _attention(impl), q, k, v, None, ct_out, ct_lse, deterministic_backward=True, **kwargs))
    first = run(q, k, v, ct_out, ct_lse)
    for _ in range(2):
        again = run(q, k, v, ct_out, ct_lse)
        for a, b, what in zip(first[2], again[2], ("dq", "dk", "dv")):
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32), err_msg=what)
    kwargs.pop("max_segments_per_row", None)
    _, _, r_grads = reference64(q, k, v, None, ct_out, ct_lse, **kwargs)
    for g, rg, what in zip(first[2], r_grads, ("dq", "dk", "dv")):
        assert_close(g, rg, OUT_TOL[jnp.bfloat16], what)


def test_deterministic_backward_reaches_the_kernels():
    """The option is an attribute of the backward targets (and changes nothing in the forward)."""
    q, k, v = random_inputs(3, 1, 256, 256, 2, 2, 128, 128, jnp.bfloat16)
    for impl in BACKENDS:
        hlo = {}
        for det in (False, True):
            loss = lambda q, k, v: jnp.sum(maxattn.dot_product_attention(
                q, k, v, is_causal=True, implementation=impl, deterministic_backward=det).astype(jnp.float32))
            hlo[det] = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(q, k, v).as_text()
        assert "deterministic = true" in hlo[True] and "deterministic = true" not in hlo[False], impl

"""The CPU backend against the float64 reference over the feature matrix.

dtypes x masks x {MHA, GQA, MQA} x {bias, none} x {soft cap, none}: out, lse,
max_logit and the gradients of q, k, v, bias, with docs/contract.md's tolerances.
"""

from __future__ import annotations

import itertools
import zlib

import jax.numpy as jnp
import numpy as np
import pytest

import maxattn
from helpers import (MAX_TOL, OUT_TOL, assert_close, assert_max_logit_close, loss_and_grads,
                     random_inputs, reference64, use_xla_backend_in_key_blocks)

DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}
MASKS = ["none", "causal", "causal_bottom_right", "padding", "segments", "window", "dense"]
HEADS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}
BIAS_SHAPES = ["BNTS", "1NTS", "B11S"]


def _case_inputs(seed, dtype, mask, heads, with_bias, B=2, H=16, Hv=24):
    N, K = HEADS[heads]
    T, S = (29, 45) if mask == "causal_bottom_right" else (37, 37)
    q, k, v = random_inputs(seed, B, T, S, N, K, H, Hv, dtype)
    rng = np.random.default_rng(seed + 1)
    kwargs = {}
    if mask == "causal":
        kwargs["is_causal"] = True
    elif mask == "causal_bottom_right":
        kwargs.update(is_causal=True, causal_alignment="bottom_right")
    elif mask == "padding":
        kwargs["query_seq_lengths"] = jnp.asarray([T - 5, 11], jnp.int32)
        kwargs["key_value_seq_lengths"] = jnp.asarray([S, 17], jnp.int32)
    elif mask == "segments":
        seg = np.sort(rng.integers(0, 4, size=(B, T)), axis=1).astype(np.int32)
        kwargs["q_segment_ids"] = jnp.asarray(seg)
        kwargs["kv_segment_ids"] = jnp.asarray(seg)
    elif mask == "window":
        kwargs["local_window_size"] = (5, 3)
    elif mask == "dense":
        kwargs["mask"] = jnp.asarray(rng.random((B, 1, T, S)) < 0.7)
    bias = None
    if with_bias:
        shape = BIAS_SHAPES[seed % len(BIAS_SHAPES)]
        full = dict(B=B, N=N, T=T, S=S)
        bias = jnp.asarray(rng.standard_normal([full.get(c, 1) for c in shape]), jnp.float32)
    ct_out = jnp.asarray(rng.standard_normal((B, T, N, Hv)), jnp.float32)
    ct_lse = jnp.asarray(rng.standard_normal((B, N, T)), jnp.float32)
    return q, k, v, bias, ct_out, ct_lse, kwargs


def _attention(q, k, v, bias, mask=None, **kwargs):
    return maxattn.dot_product_attention(q, k, v, bias, mask, **kwargs)


def check_against_reference(q, k, v, bias, ct_out, ct_lse, dtype, setup=None, **kwargs):
    """setup: run after the float64 oracle and before the call under test (to reroute the latter)."""
    r_out, r_aux, r_grads = reference64(q, k, v, bias, ct_out, ct_lse, **kwargs)
    if setup is not None:
        setup()
    out, aux, grads = loss_and_grads(_attention, q, k, v, bias, ct_out, ct_lse, **kwargs)
    tol = OUT_TOL[dtype]
    assert out.dtype == q.dtype
    assert aux["max_logit"].dtype == jnp.float32 and aux["lse"].dtype == jnp.float32
    assert_close(out, r_out, tol, "out")
    assert_close(aux["lse"], r_aux["lse"], min(tol, 1e-3) if dtype != jnp.float32 else tol, "lse")
    assert_max_logit_close(aux["max_logit"], r_aux["max_logit"], MAX_TOL[dtype])
    for name, g, rg in zip(("dq", "dk", "dv", "dbias"), grads, r_grads):
        assert g.shape == rg.shape, name
        assert not np.isnan(np.asarray(g, np.float32)).any(), f"{name} has NaN"
        assert_close(g, rg, tol, name)


MATRIX = list(itertools.product(DTYPES, MASKS, HEADS, (False, True), (False, True)))


@pytest.mark.parametrize("dtype,mask,heads,with_bias,softcap", MATRIX,
                         ids=["-".join([d, m, h, "bias" if b else "nobias", "cap" if c else "nocap"])
                              for d, m, h, b, c in MATRIX])
def test_cpu_matches_float64_reference(dtype, mask, heads, with_bias, softcap):
    seed = zlib.crc32(f"{dtype}{mask}{heads}{with_bias}{softcap}".encode())
    dt = DTYPES[dtype]
    q, k, v, bias, ct_out, ct_lse, kwargs = _case_inputs(seed, dt, mask, heads, with_bias)
    if softcap:
        kwargs["logits_soft_cap"] = 2.5
    check_against_reference(q, k, v, bias, ct_out, ct_lse, dt, implementation="cpu", **kwargs)


# The xla backend's backward walks the keys in blocks (backends/xla.py, KEY_BLOCK); with 16-key
# blocks the matrix's S = 37 and 45 are three blocks, the last one partial. The bias takes each
# broadcast form in turn, [B, N, T, 1] (summed per block) included.
XLA_MATRIX = list(itertools.product(("f32",), MASKS, ("gqa",), (False, True), (False, True)))


@pytest.mark.parametrize("dtype,mask,heads,with_bias,softcap", XLA_MATRIX,
                         ids=["-".join([d, m, h, "bias" if b else "nobias", "cap" if c else "nocap"])
                              for d, m, h, b, c in XLA_MATRIX])
def test_xla_backward_in_key_blocks_matches_float64_reference(monkeypatch, dtype, mask, heads, with_bias, softcap):
    seed = zlib.crc32(f"xla{dtype}{mask}{heads}{with_bias}{softcap}".encode())
    dt = DTYPES[dtype]
    q, k, v, bias, ct_out, ct_lse, kwargs = _case_inputs(seed, dt, mask, heads, with_bias)
    if with_bias:
        B, T, N, _ = q.shape
        S = k.shape[1]
        shape = (["BNTS", "1NTS", "B11S", "BNT1"])[MASKS.index(mask) % 4]
        full = dict(B=B, N=N, T=T, S=S)
        bias = jnp.asarray(np.random.default_rng(seed).standard_normal([full.get(c, 1) for c in shape]), jnp.float32)
    if softcap:
        kwargs["logits_soft_cap"] = 2.5
    check_against_reference(q, k, v, bias, ct_out, ct_lse, dt, implementation="xla",
                            setup=lambda: use_xla_backend_in_key_blocks(monkeypatch, 16), **kwargs)


@pytest.mark.parametrize("H,Hv,T,S", [(1, 1, 3, 5), (40, 40, 65, 33), (72, 64, 130, 129),
                                      (128, 128, 70, 200), (256, 128, 33, 65)])
def test_cpu_odd_sizes(H, Hv, T, S):
    q, k, v = random_inputs(H * 7 + T, 1, T, S, 2, 1, H, Hv, jnp.float32)
    rng = np.random.default_rng(H)
    ct_out = jnp.asarray(rng.standard_normal((1, T, 2, Hv)), jnp.float32)
    ct_lse = jnp.asarray(rng.standard_normal((1, 2, T)), jnp.float32)
    check_against_reference(q, k, v, None, ct_out, ct_lse, jnp.float32, implementation="cpu",
                            is_causal=True, causal_alignment="bottom_right")


def test_bias_gradient_keeps_bias_dtype_and_shape():
    q, k, v = random_inputs(3, 2, 9, 11, 2, 2, 8, 8, jnp.bfloat16)
    bias = jnp.asarray(np.random.default_rng(0).standard_normal((11,)), jnp.bfloat16)
    g = jax_grad_bias(q, k, v, bias)
    assert g.shape == bias.shape and g.dtype == bias.dtype


def jax_grad_bias(q, k, v, bias):
    import jax
    return jax.grad(lambda b: maxattn.dot_product_attention(q, k, v, b, implementation="cpu")
                    .astype(jnp.float32).sum())(bias)

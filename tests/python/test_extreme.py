"""Non-finite and extreme inputs on the CPU backend.

* NaN / +-Inf in q, k, v, bias: no crash, no hang; the CPU backend gives the
  same NaN / Inf pattern as the reference (docs/contract.md: NaN propagates,
  max_logit is NaN iff a visible logit is NaN), and a NaN at a position that
  is not visible (masked, padding, causal) does not leak into q/k/bias results.
* -inf bias works as a mask; rows whose bias is all -inf are fully masked rows
  (output 0, lse -inf, finite gradients).
* |s| ~ 1e4 in float32: finite and correct lse and max_logit.
* 64-bit index arithmetic: a call whose output has more than 2^31 elements
  (bf16, 4 GiB) and one whose key has more than 2^31 elements, checked against
  float64 values computed on a sample of rows.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import maxattn
from helpers import assert_close, assert_max_logit_close, random_inputs, x64
from maxattn._src.backends import cpu as cpu_backend

pytestmark = pytest.mark.skipif(cpu_backend._maxattn_cpu is None, reason="CPU extension not built")

B, T, S, N, K, H, Hv = 2, 40, 70, 4, 2, 16, 8


def _run(q, k, v, bias=None, mask=None, impl="cpu", **kw):
    out, aux = maxattn.dot_product_attention(q, k, v, bias, mask, implementation=impl, return_max_logit=True,
                                             return_lse=True, **kw)
    return jax.tree.map(np.asarray, (out, aux["lse"], aux["max_logit"]))


def _ref(q, k, v, bias=None, mask=None, **kw):
    with x64():
        c = lambda x: None if x is None else jnp.asarray(np.asarray(x, np.float64))
        return _run(c(q), c(k), c(v), c(bias), mask, impl="xla", **kw)


def _same_pattern(got, want, what):
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=f"{what}: NaN pattern")
    np.testing.assert_array_equal(np.isposinf(got), np.isposinf(want), err_msg=f"{what}: +inf pattern")
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want), err_msg=f"{what}: -inf pattern")
    ok = np.isfinite(want)
    if ok.any():
        assert_close(got[ok], want[ok], 1e-5, what + " (finite part)")


POISON = [
    ("q", (1, 5, 2, 3)), ("k", (0, 17, 1, 0)), ("v", (1, 33, 0, 4)), ("bias", (0, 3, 7, 20)),
]


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf], ids=["nan", "posinf", "neginf"])
@pytest.mark.parametrize("where,index", POISON, ids=[p[0] for p in POISON])
@pytest.mark.parametrize("causal", [False, True])
def test_non_finite_inputs_match_reference_pattern(where, index, value, causal):
    q, k, v = random_inputs(1, B, T, S, N, K, H, Hv, jnp.float32)
    bias = jnp.asarray(np.random.default_rng(2).standard_normal((B, N, T, S)), jnp.float32)
    arrays = dict(q=q, k=k, v=v, bias=bias)
    arrays[where] = arrays[where].at[index].set(value)
    got = _run(arrays["q"], arrays["k"], arrays["v"], arrays["bias"], is_causal=causal)
    want = _ref(arrays["q"], arrays["k"], arrays["v"], arrays["bias"], is_causal=causal)
    for g, w, what in zip(got, want, ("out", "lse", "max_logit")):
        _same_pattern(g, w, f"{where}={value} {what}")
    if np.isnan(value) and where != "v" and not (causal and where == "bias"):  # (that bias entry is above the diagonal)
        # The poisoned logits are visible: their heads' max_logit is NaN, the others are not.
        assert np.isnan(got[2]).any() and not np.isnan(got[2]).all()
    # Gradients: finite where the reference's are, same NaN pattern.
    ct = jnp.asarray(np.random.default_rng(3).standard_normal((B, T, N, Hv)), jnp.float32)
    g = jax.grad(lambda q, k, v, b: jnp.sum(maxattn.dot_product_attention(
        q, k, v, b, implementation="cpu", is_causal=causal) * ct), argnums=(0, 1, 2, 3))(
            arrays["q"], arrays["k"], arrays["v"], arrays["bias"])
    with x64():
        c = lambda x: jnp.asarray(np.asarray(x, np.float64))
        rg = jax.grad(lambda q, k, v, b: jnp.sum(maxattn.reference(q, k, v, b, is_causal=causal) * c(ct)),
                      argnums=(0, 1, 2, 3))(*(c(arrays[n]) for n in ("q", "k", "v", "bias")))
        rg = [np.asarray(x) for x in rg]
    for name, a, b in zip(("dq", "dk", "dv", "dbias"), g, rg):
        a = np.asarray(a, np.float64)
        fin = np.isfinite(b)
        assert np.isfinite(a[fin]).all(), f"{where}={value} {name}: non-finite where the reference is finite"
        if fin.any():
            assert_close(a[fin], b[fin], 1e-4, f"{where}={value} {name} (finite part)")


@pytest.mark.parametrize("where", ["q", "k", "bias"])
def test_nan_at_invisible_positions_does_not_leak(where):
    """NaN in padding keys, masked-out bias entries or padded query rows stays out of the results."""
    q, k, v = random_inputs(4, B, T, S, N, K, H, Hv, jnp.float32)
    bias = jnp.asarray(np.random.default_rng(5).standard_normal((B, N, T, S)), jnp.float32)
    qlen = jnp.asarray([T, 25], jnp.int32)
    kvlen = jnp.asarray([50, S], jnp.int32)
    mask = jnp.ones((B, N, T, S), bool).at[:, :, :, 10].set(False)
    if where == "q":
        q = q.at[1, 25:].set(jnp.nan)           # padded query rows of batch 1
    elif where == "k":
        k = k.at[0, 50:].set(jnp.nan)           # padding keys of batch 0
    else:
        bias = bias.at[:, :, :, 10].set(jnp.nan)  # masked-out column
        bias = bias.at[0, :, :, 50:].set(jnp.nan)
    kw = dict(query_seq_lengths=qlen, key_value_seq_lengths=kvlen, is_causal=True, causal_alignment="bottom_right")
    got = _run(q, k, v, bias, mask, **kw)
    want = _ref(q, k, v, bias, mask, **kw)
    for g, w, what in zip(got, want, ("out", "lse", "max_logit")):
        assert not np.isnan(g).any(), f"NaN leaked into {what}"
        _same_pattern(g, w, what)
    if where == "bias":
        grads = jax.grad(lambda q, k, v, b: maxattn.dot_product_attention(
            q, k, v, b, mask, implementation="cpu", **kw).sum(), argnums=(0, 1, 2, 3))(q, k, v, bias)
        for name, g in zip(("dq", "dk", "dv", "dbias"), grads):
            assert not np.isnan(np.asarray(g)).any(), f"NaN leaked into {name}"
    # Not checked: NaN in padded q rows / padding k rows does reach dk / dq, in the reference
    # too (0 * NaN in dS^T Q and dS K); see TESTING.md.


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_minus_inf_bias_is_a_mask(dtype):
    q, k, v = random_inputs(6, B, T, S, N, K, H, Hv, dtype)
    rng = np.random.default_rng(7)
    mask = rng.random((B, 1, T, S)) < 0.5
    mask[0, 0, 3] = False  # a fully masked row
    bias = jnp.asarray(np.where(mask, 0.0, -np.inf), jnp.float32)
    a = _run(q, k, v, bias)
    b = _run(q, k, v, None, jnp.asarray(mask))
    np.testing.assert_array_equal(a[0], b[0])
    np.testing.assert_array_equal(a[1], b[1])
    assert np.isneginf(a[1][0, :, 3]).all() and (a[0][0, 3] == 0).all()
    grads = jax.grad(lambda q, k, v, bb: maxattn.dot_product_attention(
        q, k, v, bb, implementation="cpu").astype(jnp.float32).sum(), argnums=(0, 1, 2, 3))(q, k, v, bias)
    for name, g in zip(("dq", "dk", "dv", "dbias"), grads):
        assert np.isfinite(np.asarray(g, np.float32)).all(), name


@pytest.mark.parametrize("sign", ["pos", "neg", "mixed"])
@pytest.mark.parametrize("softcap", [None, 30.0])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_logits_of_order_1e4(sign, softcap, dtype):
    rng = np.random.default_rng(8)
    q, k, v = random_inputs(9, B, T, S, N, K, H, Hv, jnp.float32)
    # Unit-norm q and k rows, scale 1e4: logits in [-1e4, 1e4] with a dominant few.
    qn = q / jnp.linalg.norm(q, axis=-1, keepdims=True)
    kn = k / jnp.linalg.norm(k, axis=-1, keepdims=True)
    if sign == "pos":
        kn = kn.at[:, 7].set(jnp.repeat(qn[:, 7:8, ::N // K], 1, axis=1)[:, 0])  # s ~ +1e4 for query row 7
    elif sign == "neg":
        kn = -jnp.abs(kn) * jnp.sign(qn[:, :1, ::N // K].mean(1, keepdims=True))  # mostly negative logits
    bias = jnp.asarray(rng.standard_normal((1, N, T, S)) * (1e4 if sign == "mixed" else 1.0), jnp.float32)
    qn, kn, v = (x.astype(dtype) for x in (qn, kn, v))
    kw = dict(scale=1e4, logits_soft_cap=softcap, is_causal=True)
    got = _run(qn, kn, v, bias, **kw)
    want = _ref(qn, kn, v, bias, **kw)
    assert np.isfinite(got[1]).all() and np.isfinite(got[2]).all()
    assert np.abs(want[2]).max() > 1e3  # really large logits
    tol = 1e-5 if dtype == jnp.float32 else 1e-3
    assert_close(got[1], want[1], tol, "lse")
    assert_max_logit_close(got[2], want[2], tol)
    assert_close(got[0], want[0], 1e-5 if dtype == jnp.float32 else 2e-2, "out")


# ---------------------------------------------------------------------------
# 64-bit index arithmetic.
# ---------------------------------------------------------------------------

def _rows_reference(q_rows, k, v, scale):
    """float64 attention of the given query rows [R, H] against k [S, H], v [S, Hv]."""
    s = (q_rows.astype(np.float64) @ k.astype(np.float64).T) * scale
    m = s.max(-1, keepdims=True)
    p = np.exp(s - m)
    l = p.sum(-1, keepdims=True)
    return (p / l) @ v.astype(np.float64), (m + np.log(l))[:, 0], s.max()


def test_output_with_more_than_2_31_elements():
    """out [1, T, 1, Hv] bf16 with T * Hv > 2^31 (4 GiB); q, k, v are small."""
    Tbig, Hvbig, Ssmall, Hsmall = (1 << 21) + 3, 1024, 5, 4
    assert Tbig * Hvbig > 2**31
    rng = np.random.default_rng(10)
    q = jnp.asarray(rng.standard_normal((1, Tbig, 1, Hsmall)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((1, Ssmall, 1, Hsmall)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((1, Ssmall, 1, Hvbig)), jnp.bfloat16)
    out, aux = maxattn.dot_product_attention(q, k, v, implementation="cpu", return_lse=True,
                                             return_max_logit=True)
    rows = np.r_[0:3, 2**31 // Hvbig - 2: 2**31 // Hvbig + 2, Tbig - 3:Tbig]  # around the 2^31 boundary
    rows = np.concatenate([rows, rng.integers(0, Tbig, 20)])
    qf, kf, vf = (np.asarray(x, np.float32)[0, :, 0] for x in (q, k, v))
    r_out, r_lse, _ = _rows_reference(qf[rows], kf, vf, 0.5)
    got = np.asarray(out[0, rows, 0], np.float64)
    assert_close(got, r_out, 2e-2, "out rows")
    np.testing.assert_allclose(np.asarray(aux["lse"])[0, 0, rows], r_lse, rtol=1e-3, atol=1e-3)
    full_max = (qf.astype(np.float64) @ kf.T.astype(np.float64)).max() * 0.5
    np.testing.assert_allclose(np.asarray(aux["max_logit"]), [full_max], rtol=1e-3)
    del out


def test_key_with_more_than_2_31_elements():
    """k [1, S, 1, H] bf16 with S * H > 2^31 (4 GiB), a handful of queries.

    k is random rows tiled with period P (built on the device, so the host holds
    only the small block), except one spike key near the end, past element 2^31,
    that only query 0 matches strongly: its out must be that key's value row."""
    P, H_, Hv_ = 509, 128, 8
    reps = -(-((2**31) // H_ + 4096) // P)
    Sbig = reps * P
    rng = np.random.default_rng(11)
    block = rng.standard_normal((P, H_)).astype(np.float32) * 0.1
    spike_j = Sbig - 7
    assert spike_j * H_ > 2**31
    qv = rng.standard_normal((3, H_)).astype(np.float32)
    qv[0] = 0.0
    qv[0, :4] = 1.0

    @jax.jit
    def make():
        kk = jnp.tile(jnp.asarray(block, jnp.bfloat16), (reps, 1))
        kk = kk.at[spike_j].set(jnp.zeros((H_,), jnp.bfloat16).at[:4].set(8.0))
        vv = jnp.zeros((Sbig, Hv_), jnp.bfloat16).at[spike_j].set(jnp.arange(1, Hv_ + 1, dtype=jnp.bfloat16))
        return kk[None, :, None], vv[None, :, None]

    k, v = make()
    q = jnp.asarray(qv[None, :, None], jnp.bfloat16)
    out, aux = maxattn.dot_product_attention(q, k, v, scale=1.0, implementation="cpu", return_lse=True,
                                             return_max_logit=True)
    out = np.asarray(out, np.float32)[0, :, 0]
    lse = np.asarray(aux["lse"])[0, 0]
    # Query 0: spike logit 32 vs |s| <= 0.4 * ... for the periodic keys (about Sbig of them).
    qb = np.asarray(q, np.float32)[0, :, 0]
    kb = np.asarray(jnp.asarray(block, jnp.bfloat16), np.float32)
    s_block = qb.astype(np.float64) @ kb.T.astype(np.float64)  # [3, P]
    counts = np.full(P, Sbig // P, np.float64)
    counts[: Sbig % P] += 1
    counts[spike_j % P] -= 1  # the spike replaced one periodic key
    spike_s = qb[:, :4].sum(-1).astype(np.float64) * 8.0
    z = (counts * np.exp(s_block)).sum(-1) + np.exp(spike_s)
    r_lse = np.log(z)
    w_spike = np.exp(spike_s) / z
    r_out = w_spike[:, None] * np.arange(1, Hv_ + 1)[None, :]
    np.testing.assert_allclose(lse, r_lse, rtol=1e-3)
    np.testing.assert_allclose(out, r_out, rtol=2e-2, atol=1e-3)
    assert w_spike[0] > 0.5  # the far-away spike key dominates query 0
    r_max = max(spike_s.max(), s_block.max())
    np.testing.assert_allclose(np.asarray(aux["max_logit"]), [r_max], rtol=1e-3)

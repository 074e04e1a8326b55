"""maxattn.qk_clip: factors, apply_qk_clip on Flax layouts, the optax transform."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

optax = pytest.importorskip("optax")
pytest.importorskip("flax")
from flax import nnx  # noqa: E402

import maxattn  # noqa: E402
import maxattn.flax as mf  # noqa: E402
from maxattn.qk_clip import apply_qk_clip, clip_factors, mla_rule, qk_clip_transform  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning", "ignore::DeprecationWarning")

TAU = 30.0


@pytest.fixture(autouse=True)
def _full_f32_matmuls():
    # GPUs default to TF32 for float32 matmuls; the comparisons here need full float32.
    with jax.default_matmul_precision("highest"):
        yield


def test_clip_factors_edge_cases():
    s = jnp.array([-jnp.inf, jnp.nan, -5.0, 0.0, 10.0, TAU, 60.0, 120.0])
    q, k = clip_factors(s, TAU, alpha=0.25)
    assert q.shape == k.shape == (8,) and q.dtype == jnp.float32
    assert np.all(np.asarray(q[:6]) == 1.0) and np.all(np.asarray(k[:6]) == 1.0)
    np.testing.assert_allclose(q[6:], np.array([0.5, 0.25]) ** 0.25, rtol=1e-6)
    np.testing.assert_allclose(k[6:], np.array([0.5, 0.25]) ** 0.75, rtol=1e-6)
    assert not np.any(np.isnan(np.asarray(q))) and not np.any(np.isnan(np.asarray(k)))
    # GQA: N=8, K=2 -> per-group max; NaN heads ignored
    q, k = clip_factors(s, TAU, alpha=0.5, num_kv_heads=2)
    assert q.shape == (8,) and k.shape == (2,)
    np.testing.assert_array_equal(q[:4], 1.0)
    np.testing.assert_allclose(q[4:], np.sqrt(0.25), rtol=1e-6)
    np.testing.assert_allclose(k, [1.0, 0.5], rtol=1e-6)
    # leading (layer) axes
    q, k = clip_factors(jnp.stack([s, s]), TAU)
    assert q.shape == (2, 8)
    with pytest.raises(ValueError, match="threshold"):
        clip_factors(s, 0.0)
    with pytest.raises(ValueError, match="alpha"):
        clip_factors(s, TAU, alpha=1.5)
    with pytest.raises(ValueError, match="num_kv_heads"):
        clip_factors(s, TAU, num_kv_heads=3)


def _rope(x, base=10000.0):
    """Rotary embedding on [B, T, N, H]."""
    t, h = x.shape[1], x.shape[-1]
    freqs = base ** (-jnp.arange(0, h, 2) / h)
    ang = jnp.arange(t)[:, None] * freqs[None]
    cos, sin = jnp.cos(ang)[None, :, None], jnp.sin(ang)[None, :, None]
    x1, x2 = x[..., ::2], x[..., 1::2]
    return jnp.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], -1).reshape(x.shape)


def _max_logits(p, x, rope):
    proj = lambda name: jnp.einsum("btd,dnh->btnh", x, p[name]["kernel"]) + p[name]["bias"]
    q, k, v = proj("query"), proj("key"), proj("value")
    if rope:
        q, k = _rope(q), _rope(k)
    _, aux = maxattn.dot_product_attention(q, k, v, is_causal=True, return_max_logit=True)
    return aux["max_logit"]


def _params(num_heads, num_kv, seed, D=32, H=16, lead=()):
    ks = jax.random.split(jax.random.key(seed), 6)
    # per-head magnitudes spread so some heads are far above TAU and some below
    mag = jnp.linspace(0.2, 1.6, num_heads)[:, None]
    kmag = jnp.linspace(0.5, 1.5, num_kv)[:, None]
    w = lambda k, n, m: jax.random.normal(k, lead + (D, n, H)) * m
    b = lambda k, n: 0.3 * jax.random.normal(k, lead + (n, H))
    return {"attn": {"query": {"kernel": w(ks[0], num_heads, mag), "bias": b(ks[1], num_heads)},
                     "key": {"kernel": w(ks[2], num_kv, kmag), "bias": b(ks[3], num_kv)},
                     "value": {"kernel": w(ks[4], num_kv, 1.0), "bias": b(ks[5], num_kv)}}}


@pytest.mark.parametrize("num_kv,rope", [(8, False), (8, True), (2, True), (1, False)])
def test_apply_qk_clip_caps_max_logit(num_kv, rope):
    N = 8
    params = _params(N, num_kv, seed=num_kv + rope)
    x = jax.random.normal(jax.random.key(7), (2, 16, 32))
    s = _max_logits(params["attn"], x, rope)
    assert float(jnp.max(s)) > 2 * TAU and float(jnp.min(s)) < TAU  # both kinds present
    new = apply_qk_clip(params, {("attn",): s}, threshold=TAU, alpha=0.5)
    s2 = _max_logits(new["attn"], x, rope)
    G = N // num_kv
    sg = s.reshape(num_kv, G).max(-1)
    eta = jnp.repeat(jnp.minimum(1.0, TAU / sg), G)
    np.testing.assert_allclose(s2, s * eta, rtol=1e-4)  # every head scales by its group's eta
    np.testing.assert_allclose(s2.reshape(num_kv, G).max(-1), jnp.minimum(sg, TAU), rtol=1e-4)
    if num_kv == N:
        np.testing.assert_allclose(s2, jnp.minimum(s, TAU), rtol=1e-4)
    # heads (groups) under tau: bit for bit
    qk, nk = params["attn"]["query"]["kernel"], new["attn"]["query"]["kernel"]
    for n in range(N):
        if float(sg[n // G]) <= TAU:
            assert np.array_equal(np.asarray(qk[:, n]), np.asarray(nk[:, n]))
            assert np.array_equal(np.asarray(params["attn"]["query"]["bias"][n]),
                                  np.asarray(new["attn"]["query"]["bias"][n]))
    for kv in range(num_kv):
        if float(sg[kv]) <= TAU:
            assert np.array_equal(np.asarray(params["attn"]["key"]["kernel"][:, kv]),
                                  np.asarray(new["attn"]["key"]["kernel"][:, kv]))
    assert new["attn"]["value"] is params["attn"]["value"] or jax.tree.all(
        jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), new["attn"]["value"],
                     params["attn"]["value"]))


def test_apply_qk_clip_scan_axes_and_nnx_state():
    L, N = 3, 4
    params = _params(N, N, seed=3, lead=(L,))
    s = jnp.array([[10.0, 40.0, 90.0, 29.0]] * L) * jnp.arange(1, L + 1)[:, None]
    new = apply_qk_clip({"params": params}, {"intermediates": {"attn": {"max_logit": (s,)}}},
                        threshold=TAU)
    q, _ = clip_factors(s, TAU)
    np.testing.assert_allclose(new["params"]["attn"]["query"]["kernel"],
                               params["attn"]["query"]["kernel"] * q[:, None, :, None], rtol=1e-6)
    # nnx State of a real MultiHeadAttention, max logits from capture
    mha = nnx.MultiHeadAttention(N, 16, 32, decode=False, attention_fn=mf.attention_fn,
                                 rngs=nnx.Rngs(0))
    x = 20 * jax.random.normal(jax.random.key(1), (2, 8, 16))
    _, ml = mf.capture_max_logits(lambda m, x: m(x, sow_weights=True), mha, x)
    tau = float(jnp.median(ml[()]))
    state = nnx.state(mha, nnx.Param)
    nnx.update(mha, apply_qk_clip(state, ml, threshold=tau))
    _, ml2 = mf.capture_max_logits(lambda m, x: m(x, sow_weights=True), mha, x)
    np.testing.assert_allclose(ml2[()], jnp.minimum(ml[()], tau), rtol=1e-4)


def test_apply_qk_clip_errors_and_custom_rule():
    params = _params(4, 4, seed=0)
    with pytest.raises(ValueError, match="no 'max_logit'"):
        apply_qk_clip(params, {}, threshold=TAU)
    with pytest.raises(ValueError, match="no matching"):
        apply_qk_clip(params, {("other",): jnp.ones(4)}, threshold=TAU)
    with pytest.raises(ValueError, match="heads"):
        apply_qk_clip(params, {("attn",): jnp.ones(5)}, threshold=TAU)
    # MLA-style custom layout
    ks = jax.random.split(jax.random.key(0), 3)
    mla = {"attn": {"q_nope": {"kernel": jax.random.normal(ks[0], (8, 4, 6))},
                    "q_rope": {"kernel": jax.random.normal(ks[1], (8, 4, 2))},
                    "k_nope": {"kernel": jax.random.normal(ks[2], (8, 4, 6))},
                    "k_rope": {"kernel": jnp.ones((8, 2))}}}
    s = jnp.array([10.0, 60.0, 120.0, 5.0])
    new = apply_qk_clip(mla, {("attn",): s}, threshold=TAU, rule=mla_rule())
    eta = jnp.minimum(1.0, TAU / s)
    a = lambda t, name: t["attn"][name]["kernel"]
    np.testing.assert_allclose(a(new, "q_nope"), a(mla, "q_nope") * jnp.sqrt(eta)[:, None], rtol=1e-6)
    np.testing.assert_allclose(a(new, "k_nope"), a(mla, "k_nope") * jnp.sqrt(eta)[:, None], rtol=1e-6)
    np.testing.assert_allclose(a(new, "q_rope"), a(mla, "q_rope") * eta[:, None], rtol=1e-6)
    assert np.array_equal(a(new, "k_rope"), a(mla, "k_rope"))


def test_optax_transform_matches_apply_qk_clip():
    params = _params(8, 2, seed=11)
    x = jax.random.normal(jax.random.key(7), (2, 16, 32))
    grads = jax.tree.map(lambda p: 0.01 * jnp.ones_like(p), params)
    s = _max_logits(params["attn"], x, rope=True)
    sg = s.reshape(2, 4).max(-1)
    tau = float(jnp.sqrt(jnp.min(sg) * jnp.max(sg)))  # one group clipped, one not
    inner = optax.adam(1e-2)
    plain, _ = jax.jit(inner.update)(grads, inner.init(params), params)
    clip_tx = qk_clip_transform(tau, alpha=0.5)
    out, _ = jax.jit(lambda u, p, s: clip_tx.update(u, clip_tx.init(p), p, max_logits={("attn",): s}))(
        plain, params, s)
    new = optax.apply_updates(params, out)
    expected = apply_qk_clip(optax.apply_updates(params, plain), {("attn",): s}, threshold=tau)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7), new, expected)
    # unclipped kv group and other parameters: the incoming updates, bit for bit
    for g in range(2):
        same = np.array_equal(out["attn"]["key"]["kernel"][:, g], plain["attn"]["key"]["kernel"][:, g])
        assert same == (float(sg[g]) <= tau)
    assert np.array_equal(out["attn"]["value"]["kernel"], plain["attn"]["value"]["kernel"])
    # chained after the optimizer, under jit
    tx = optax.chain(inner, clip_tx)
    opt_state = tx.init(params)
    step = jax.jit(lambda p, o, s: tx.update(grads, o, p, max_logits={("attn",): s}))
    chained, _ = step(params, opt_state, s)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7),
                 optax.apply_updates(params, chained), expected)
    with pytest.raises(ValueError, match="max_logits"):
        tx.update(grads, opt_state, params)

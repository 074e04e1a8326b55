"""maxattn.flax: attention_fn in Flax layers, sown max logits, DotProductAttention modules."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

flax = pytest.importorskip("flax")
from flax import linen as nn  # noqa: E402
from flax import nnx  # noqa: E402

import maxattn  # noqa: E402
import maxattn.flax as mf  # noqa: E402
from maxattn.flax.linen import DotProductAttention as LinenDPA  # noqa: E402
from maxattn.flax.nnx import DotProductAttention as NnxDPA  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::RuntimeWarning", "ignore::DeprecationWarning")

D, N, H, T, B = 16, 4, 8, 8, 2


@pytest.fixture(autouse=True)
def _full_f32_matmuls():
    # GPUs default to TF32 for float32 matmuls; the comparisons here need full float32.
    with jax.default_matmul_precision("highest"):
        yield


def _x(seed=0, shape=(B, T, D)):
    return jax.random.normal(jax.random.key(seed), shape, jnp.float32)


def _direct_max(q, k, v, **kw):
    _, aux = maxattn.dot_product_attention(q, k, v, return_max_logit=True, **kw)
    return aux["max_logit"]


def _close(a, b, rtol=1e-5):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=rtol, atol=1e-5)


class NnxBlock(nnx.Module):
    def __init__(self, rngs):
        self.attn = nnx.MultiHeadAttention(
            N, D, N * H, decode=False, attention_fn=mf.attention_fn, rngs=rngs)

    def __call__(self, x):
        return x + self.attn(x, sow_weights=True, is_causal=True)


def _nnx_expected(attn, x):
    q, k, v = attn.query(x), attn.key(x), attn.value(x)
    return _direct_max(q, k, v, is_causal=True)


def test_nnx_mha_output_and_sown_value():
    mha = nnx.MultiHeadAttention(N, D, N * H, decode=False, attention_fn=mf.attention_fn,
                                 rngs=nnx.Rngs(0))
    ref = nnx.MultiHeadAttention(N, D, N * H, decode=False, rngs=nnx.Rngs(0))
    x = _x()
    mask = nnx.make_causal_mask(jnp.ones((B, T)))
    y, ml = mf.capture_max_logits(lambda m, x: m(x, mask=mask, sow_weights=True), mha, x)
    _close(y, ref(x, mask=mask))
    assert list(ml) == [()]
    assert ml[()].shape == (N,) and ml[()].dtype == jnp.float32
    _close(ml[()], _nnx_expected(mha, x))
    # without sow_weights nothing is recorded, output unchanged
    y2, ml2 = mf.capture_max_logits(lambda m, x: m(x, mask=mask), mha, x)
    _close(y2, y)
    assert ml2 == {}


def test_nnx_jit_list_of_layers():
    class Model(nnx.Module):
        def __init__(self, rngs):
            self.blocks = nnx.List([NnxBlock(rngs) for _ in range(2)])

        def __call__(self, x):
            for b in self.blocks:
                x = b(x)
            return x

    model, x = Model(nnx.Rngs(1)), _x(1)
    y, ml = nnx.jit(lambda m, x: mf.capture_max_logits(lambda m, x: m(x), m, x))(model, x)
    assert sorted(ml) == [("blocks", 0, "attn"), ("blocks", 1, "attn")]
    h = x
    for i, blk in enumerate(model.blocks):
        _close(ml[("blocks", i, "attn")], _nnx_expected(blk.attn, h))
        h = blk(h)
    _close(y, h)


def test_nnx_scan_and_remat_over_layers():
    L = 3

    @nnx.split_rngs(splits=L)
    @nnx.vmap(in_axes=0, out_axes=0)
    def create(rngs):
        return NnxBlock(rngs)

    blocks = create(nnx.Rngs(2))
    x = _x(2)

    def run(blocks, x):
        @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry)
        @nnx.remat
        def step(b, x):
            return b(x)
        return step(blocks, x)

    y, ml = nnx.jit(lambda b, x: mf.capture_max_logits(run, b, x))(blocks, x)
    assert list(ml) == [("attn",)] and ml[("attn",)].shape == (L, N)
    # one row per layer: recompute layer by layer
    graphdef, state = nnx.split(blocks)
    h = x
    for i in range(L):
        blk = nnx.merge(graphdef, jax.tree.map(lambda a: a[i], state))
        _close(ml[("attn",)][i], _nnx_expected(blk.attn, h))
        h = blk(h)
    _close(y, h)

    # gradients flow through remat + scan with recording on
    def loss(b, x):
        out, _ = mf.capture_max_logits(run, b, x)
        return jnp.sum(out ** 2)
    g = nnx.grad(loss)(blocks, x)
    assert all(bool(jnp.all(jnp.isfinite(a))) for a in jax.tree.leaves(nnx.state(g, nnx.Param)))


class LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, x, _=None):
        mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
        y = nn.MultiHeadDotProductAttention(
            num_heads=N, qkv_features=N * H, attention_fn=mf.attention_fn, name="attn")(
                x, mask=mask, sow_weights=True)
        return x + y, None


def _linen_expected(params, x):
    mask = nn.make_causal_mask(jnp.ones(x.shape[:2])).astype(bool)
    proj = lambda name: jnp.einsum("btd,dnh->btnh", x, params[name]["kernel"]) + params[name]["bias"]
    return _direct_max(proj("query"), proj("key"), proj("value"), mask=mask)


def test_linen_mha_jit_matches_flax_and_direct():
    x = _x(3)
    model = LinenBlock()
    variables = model.init(jax.random.key(0), x)
    (y, _), inter = jax.jit(lambda v, x: model.apply(v, x, mutable=["intermediates"]))(variables, x)
    ml = mf.collect_max_logits(inter)
    assert list(ml) == [("attn",)]
    _close(ml[("attn",)], _linen_expected(variables["params"]["attn"], x))

    class Ref(nn.Module):
        @nn.compact
        def __call__(self, x):
            mask = nn.make_causal_mask(jnp.ones(x.shape[:2]))
            return x + nn.MultiHeadDotProductAttention(num_heads=N, qkv_features=N * H,
                                                       name="attn")(x, mask=mask)
    _close(y, Ref().apply(variables, x))


def test_linen_scan_and_remat_over_layers():
    L = 3

    class Stack(nn.Module):
        @nn.compact
        def __call__(self, x):
            body = nn.remat(LinenBlock, prevent_cse=False)
            scanned = nn.scan(body, variable_axes={"params": 0, "intermediates": 0},
                              split_rngs={"params": True}, length=L)
            x, _ = scanned(name="layers")(x, None)
            return x

    x = _x(4)
    model = Stack()
    variables = model.init(jax.random.key(1), x)
    y, inter = jax.jit(lambda v, x: model.apply(v, x, mutable=["intermediates"]))(variables, x)
    ml = mf.collect_max_logits(inter)
    assert list(ml) == [("layers", "attn")] and ml[("layers", "attn")].shape == (L, N)
    p = variables["params"]["layers"]["attn"]
    h = x
    for i in range(L):
        pi = jax.tree.map(lambda a: a[i], p)
        _close(ml[("layers", "attn")][i], _linen_expected(pi, h))
        h, _ = LinenBlock().apply({"params": {"attn": pi}}, h)
    _close(y, h)
    g = jax.grad(lambda v: jnp.sum(model.apply(v, x) ** 2))(variables)
    assert all(bool(jnp.all(jnp.isfinite(a))) for a in jax.tree.leaves(g))


def _qkv(seed=5, k_heads=2):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    return (jax.random.normal(kq, (B, T, N, H)), jax.random.normal(kk, (B, T, k_heads, H)),
            jax.random.normal(kv, (B, T, k_heads, H)))


def test_attention_fn_direct_gqa_multi_batch_dims():
    q, k, v = _qkv()
    q2, k2, v2 = (a.reshape((1,) + a.shape) for a in (q, k, v))  # batch dims (1, B)
    mask = jax.random.bernoulli(jax.random.key(9), 0.7, (1, B, 1, T, T))
    out = mf.attention_fn(q2, k2, v2, mask=mask)
    ref = maxattn.dot_product_attention(q, k, v, mask=mask[0])
    assert out.shape == (1, B, T, N, H)
    _close(out[0], ref)


def test_make_attention_fn_kwargs_and_errors():
    q, k, v = _qkv(k_heads=N)
    fn = mf.make_attention_fn(implementation="xla", is_causal=True, scale=0.5)
    _close(fn(q, k, v), maxattn.dot_product_attention(q, k, v, is_causal=True, scale=0.5))
    # Dropout (issue 7) runs in the kernel when not deterministic; it needs the rng.
    dropped = fn(q, k, v, dropout_rate=0.1, deterministic=False, dropout_rng=jax.random.key(0))
    _close(dropped, maxattn.dot_product_attention(q, k, v, is_causal=True, scale=0.5, implementation="xla",
                                                  dropout_rate=0.1, dropout_rng=jax.random.key(0)))
    assert not jnp.allclose(dropped, fn(q, k, v))
    with pytest.raises(ValueError, match="dropout_rng"):
        fn(q, k, v, dropout_rate=0.1, deterministic=False)
    _close(fn(q, k, v, dropout_rate=0.1, deterministic=True), fn(q, k, v))
    with pytest.raises(TypeError, match="return_max_logit"):
        mf.make_attention_fn(return_max_logit=True)
    with pytest.raises(TypeError, match="module"):
        mf.sow_max_logit(object(), jnp.zeros(N))


def test_dot_product_attention_modules():
    q, k, v = _qkv(k_heads=2)
    direct_out, direct_aux = maxattn.dot_product_attention(q, k, v, is_causal=True,
                                                           return_max_logit=True)
    # nnx
    out, aux = NnxDPA(is_causal=True, return_max_logit=True)(q, k, v)
    _close(out, direct_out)
    _close(aux["max_logit"], direct_aux["max_logit"])
    rec = NnxDPA(is_causal=True, record_max_logit=True)
    out, ml = mf.capture_max_logits(lambda m, *a: m(*a), rec, q, k, v)
    _close(out, direct_out)
    _close(ml[()], direct_aux["max_logit"])
    # linen
    m = LinenDPA(is_causal=True, return_max_logit=True)
    out, aux = m.apply({}, q, k, v)
    _close(aux["max_logit"], direct_aux["max_logit"])
    out, inter = LinenDPA(is_causal=True, record_max_logit=True).apply(
        {}, q, k, v, mutable=["intermediates"])
    _close(out, direct_out)
    _close(mf.collect_max_logits(inter)[()], direct_aux["max_logit"])

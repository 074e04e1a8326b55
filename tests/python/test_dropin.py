"""maxattn as a drop-in for jax.nn.dot_product_attention and Flax's attention (issue 16).

Call patterns that jax.nn and Flax document, run side by side with those libraries on the "cpu" and
"xla" backends; global JAX configuration; autodiff modes; the validation jax.nn makes.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import maxattn
from helpers import assert_close, random_inputs

IMPLS = ["cpu", "xla"]
TOL = 2e-6


def _close(a, b, what):
    assert a.shape == b.shape, (what, a.shape, b.shape)
    assert_close(a, b, TOL, what)


# ----------------------------------------------------------------------------
# jax.nn call patterns.


def _jax_nn_cases():
    rng = np.random.default_rng(0)
    T, S, N, K, H = 12, 16, 4, 2, 8
    lens = (jnp.array([12, 7], jnp.int32), jnp.array([16, 9], jnp.int32))
    return {
        "batched": ((2, T, S, N, K, H), {}),
        "batched_causal_gqa": ((2, T, T, N, K, H), dict(is_causal=True)),
        "unbatched": ((None, T, S, N, K, H), {}),
        "unbatched_causal": ((None, T, T, N, N, H), dict(is_causal=True)),
        "bias_BNTS": ((2, T, S, N, K, H), dict(bias=rng.standard_normal((2, N, T, S)))),
        "bias_unbatched_NTS": ((None, T, S, N, K, H), dict(bias=rng.standard_normal((N, T, S)))),
        "mask_B1TS": ((2, T, S, N, K, H), dict(mask=rng.random((2, 1, T, S)) > 0.3)),
        "mask_unbatched_TS": ((None, T, S, N, K, H), dict(mask=np.tril(np.ones((T, S), bool)))),
        "lengths": ((2, T, S, N, K, H), dict(query_seq_lengths=lens[0], key_value_seq_lengths=lens[1])),
        "unbatched_lengths": ((None, T, S, N, K, H), dict(query_seq_lengths=jnp.array([5], jnp.int32),
                                                          key_value_seq_lengths=jnp.array([11], jnp.int32))),
        "window_int": ((2, T, T, N, K, H), dict(local_window_size=3)),
        "window_tuple_causal": ((2, T, T, N, K, H), dict(local_window_size=(4, 0), is_causal=True)),
        "scale_float": ((2, T, S, N, K, H), dict(scale=0.25)),
        "scale_jax_scalar": ((2, T, S, N, K, H), dict(scale=1 / jnp.sqrt(16.0))),
        "scale_numpy_scalar": ((None, T, S, N, K, H), dict(scale=np.float32(0.5))),
    }


def _arrays(dims, seed=0):
    B, T, S, N, K, H = dims
    q, k, v = random_inputs(seed, B or 1, T, S, N, K, H, H, jnp.float32)
    if B is None:
        q, k, v = q[0], k[0], v[0]
    return q, k, v


def _kw(kw):
    out = {}
    for name, x in kw.items():
        out[name] = jnp.asarray(x, jnp.float32) if name == "bias" else (jnp.asarray(x) if name == "mask" else x)
    return out


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", list(_jax_nn_cases()))
def test_same_results_as_jax_nn(impl, case):
    dims, kw = _jax_nn_cases()[case]
    q, k, v = _arrays(dims)
    kw = _kw(kw)
    theirs = jax.nn.dot_product_attention(q, k, v, implementation="xla", **kw)
    ours = maxattn.dot_product_attention(q, k, v, implementation=impl, **kw)
    valid = np.ones(theirs.shape, bool)
    if "query_seq_lengths" in kw:  # jax.nn leaves padding rows unspecified; maxattn returns 0 there
        T = q.shape[-3]
        rows = np.arange(T)[None, :] < np.asarray(kw["query_seq_lengths"])[:, None]
        valid = np.broadcast_to(rows.reshape(rows.shape + (1, 1)) if q.ndim == 4 else rows[0][:, None, None],
                                theirs.shape)
        assert np.all(np.asarray(ours)[~valid] == 0)
    _close(jnp.where(valid, ours, 0), jnp.where(valid, theirs, 0), case)
    # Residual as jax.nn spells it.
    _, r_theirs = jax.nn.dot_product_attention(q, k, v, implementation="xla", return_residual=True, **kw)
    _, r_ours = maxattn.dot_product_attention(q, k, v, implementation=impl, return_residual=True, **kw)
    assert r_ours.shape == r_theirs.shape and r_ours.dtype == r_theirs.dtype
    rvalid = valid[..., 0]
    _close(jnp.where(rvalid, r_ours, 0), jnp.where(rvalid, r_theirs, 0), case + " residual")


@pytest.mark.parametrize("impl", IMPLS)
def test_unbatched_aux_shapes_and_grads(impl):
    q, k, v = _arrays((None, 12, 16, 4, 2, 8))
    out, aux = maxattn.dot_product_attention(q, k, v, implementation=impl, return_max_logit=True, return_lse=True)
    assert out.shape == (12, 4, 8) and aux["lse"].shape == (4, 12) and aux["max_logit"].shape == (4,)
    _, ref = maxattn.dot_product_attention(q[None], k[None], v[None], implementation="xla", return_max_logit=True,
                                           return_lse=True)
    _close(aux["lse"], ref["lse"][0], "lse")
    np.testing.assert_allclose(aux["max_logit"], ref["max_logit"], rtol=1e-6)
    g = jax.grad(lambda q: maxattn.dot_product_attention(q, k, v, implementation=impl).sum())(q)
    gref = jax.grad(lambda q: jax.nn.dot_product_attention(q, k, v).sum())(q)
    _close(g, gref, "dq")


@pytest.mark.parametrize("impl", IMPLS)
def test_jit_vmap_and_static_scale(impl):
    q, k, v = _arrays((3, 8, 8, 2, 2, 8))
    f = jax.jit(lambda q, k, v, s: maxattn.dot_product_attention(q, k, v, scale=s, implementation=impl),
                static_argnames="s")
    _close(f(q, k, v, s=0.3), jax.nn.dot_product_attention(q, k, v, scale=0.3), "jit static scale")
    # vmap over unbatched calls = the batched call.
    vm = jax.vmap(lambda q, k, v: maxattn.dot_product_attention(q, k, v, implementation=impl))(q, k, v)
    _close(vm, jax.nn.dot_product_attention(q, k, v), "vmap of unbatched")


# ----------------------------------------------------------------------------
# Flax attention layers with maxattn.flax.attention_fn, any number of leading batch axes.

flax = pytest.importorskip("flax")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("lead", [(), (2,), (2, 3)])
def test_nnx_multihead_attention(impl, lead):
    from flax import nnx

    import maxattn.flax as mf
    fn = mf.make_attention_fn(implementation=impl)
    x = jax.random.normal(jax.random.key(0), lead + (10, 16))
    ours = nnx.MultiHeadAttention(4, 16, 16, decode=False, attention_fn=fn, rngs=nnx.Rngs(0))
    theirs = nnx.MultiHeadAttention(4, 16, 16, decode=False, rngs=nnx.Rngs(0))
    mask = nnx.make_causal_mask(jnp.ones(lead + (10,)))
    _close(ours(x), theirs(x), "nnx no mask")
    _close(ours(x, mask=mask), theirs(x, mask=mask), "nnx causal mask")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("lead", [(), (3,), (2, 2)])
def test_linen_multihead_attention(impl, lead):
    from flax import linen as nn

    import maxattn.flax as mf
    x = jax.random.normal(jax.random.key(1), lead + (9, 16))
    ours = nn.MultiHeadDotProductAttention(num_heads=2, attention_fn=mf.make_attention_fn(implementation=impl))
    theirs = nn.MultiHeadDotProductAttention(num_heads=2)
    params = theirs.init(jax.random.key(2), x)
    _close(ours.apply(params, x), theirs.apply(params, x), "linen")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("lead", [(), (2, 3)])
def test_dot_product_attention_modules_take_leading_axes(impl, lead):
    from flax import nnx

    from maxattn.flax import linen as mlinen
    from maxattn.flax import nnx as mnnx
    q = jax.random.normal(jax.random.key(3), lead + (7, 4, 8))
    k = jax.random.normal(jax.random.key(4), lead + (9, 2, 8))
    flat = lambda x: x.reshape((-1,) + x.shape[-3:])
    ref_out, ref_aux = maxattn.dot_product_attention(flat(q), flat(k), flat(k), is_causal=True, implementation="xla",
                                                     return_lse=True, return_max_logit=True)
    m = mnnx.DotProductAttention(is_causal=True, implementation=impl, return_lse=True, return_max_logit=True)
    out, aux = m(q, k, k)
    _close(out, ref_out.reshape(lead + ref_out.shape[1:]), "nnx module out")
    _close(aux["lse"], ref_aux["lse"].reshape(lead + ref_aux["lse"].shape[1:]), "nnx module lse")
    lm = mlinen.DotProductAttention(is_causal=True, implementation=impl)
    _close(lm.apply({}, q, k, k), ref_out.reshape(lead + ref_out.shape[1:]), "linen module out")
    del nnx


# ----------------------------------------------------------------------------
# Global JAX configuration.

CONFIGS = {
    "rank_promotion_raise": lambda: jax.numpy_rank_promotion("raise"),
    "debug_nans": lambda: jax.debug_nans(True),
    "debug_infs": lambda: jax.debug_infs(True),
    "disable_jit": lambda: jax.disable_jit(),
}


def _run_all_features(impl):
    q, k, v = _arrays((2, 8, 8, 4, 2, 8), seed=5)
    bias = jnp.asarray(np.random.default_rng(1).standard_normal((1, 4, 8, 8)), jnp.float32)
    kw = dict(is_causal=True, local_window_size=(5, 0), logits_soft_cap=20.0, implementation=impl)

    def loss(q, k, v, bias):
        out, aux = maxattn.dot_product_attention(q, k, v, bias, return_max_logit=True, return_lse=True, **kw)
        return jnp.sum(out ** 2) + jnp.sum(aux["lse"]), aux["max_logit"]

    (val, mx), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(q, k, v, bias)
    return jax.block_until_ready((val, mx, grads))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("config", list(CONFIGS))
def test_clean_under_global_configuration(impl, config):
    expected = _run_all_features(impl)
    with CONFIGS[config]():
        got = _run_all_features(impl)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
        assert_close(a, b, 1e-6, config)


@pytest.mark.parametrize("impl", IMPLS)
def test_enable_x64(impl):
    from helpers import x64
    expected = _run_all_features(impl)
    with x64():
        got = _run_all_features(impl)  # float32 inputs stay float32; integer defaults become 64-bit
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
        assert a.dtype == b.dtype
        assert_close(a, b, 1e-6, "x64")


# ----------------------------------------------------------------------------
# Autodiff modes.


def test_forward_mode_and_second_order_on_xla():
    q, k, v = _arrays((1, 6, 6, 2, 2, 4), seed=7)
    f = lambda q: maxattn.dot_product_attention(q, k, v, is_causal=True, implementation="xla")
    g = lambda q: jax.nn.dot_product_attention(q, k, v, is_causal=True)
    _close(jax.jvp(f, (q,), (v,))[1], jax.jvp(g, (q,), (v,))[1], "jvp")
    _close(jax.jacfwd(f)(q), jax.jacfwd(g)(q), "jacfwd")
    h = lambda fn: jax.hessian(lambda q: jnp.sum(fn(q) ** 3))(q)
    _close(h(f), h(g), "hessian")


def test_fused_backend_autodiff_limits_are_clear():
    q, k, v = _arrays((1, 6, 6, 2, 2, 4), seed=8)
    f = lambda q: maxattn.dot_product_attention(q, k, v, implementation="cpu").sum()
    with pytest.raises(TypeError, match="forward-mode"):
        jax.jvp(f, (q,), (q,))
    for second in (lambda: jax.grad(lambda q: jax.grad(f)(q).sum())(q), lambda: jax.hessian(f)(q)):
        with pytest.raises(NotImplementedError, match='no second-order derivatives.*implementation="xla"'):
            second()


# ----------------------------------------------------------------------------
# Validation jax.nn makes, and argument ranges.


@pytest.mark.parametrize("impl", IMPLS)
def test_rank_mismatch_is_rejected(impl):
    q, k, v = _arrays((2, 8, 8, 2, 2, 4))
    with pytest.raises(ValueError, match="`key` must have the rank of `query`"):
        maxattn.dot_product_attention(q, k[0], v, implementation=impl)
    with pytest.raises(ValueError, match="`value` must have the rank of `query`"):
        maxattn.dot_product_attention(q[0], k[0], v, implementation=impl)
    with pytest.raises(ValueError, match="`query` must have rank 4"):
        maxattn.dot_product_attention(q[0, 0], k, v, implementation=impl)


@pytest.mark.parametrize("impl", IMPLS)
def test_huge_window_is_unbounded(impl):
    q, k, v = _arrays((2, 8, 8, 2, 2, 4))
    for w in (2 ** 63, (2 ** 70, 3), np.int64(2 ** 62)):
        got = maxattn.dot_product_attention(q, k, v, local_window_size=w, implementation=impl)
        right = w[1] if isinstance(w, tuple) else None
        want = maxattn.dot_product_attention(q, k, v, implementation="xla",
                                             local_window_size=None if right is None else (8, right))
        _close(got, want, f"window {w}")
    with pytest.raises(ValueError, match="`local_window_size` must be non-negative"):
        maxattn.dot_product_attention(q, k, v, local_window_size=(-1, 2), implementation=impl)


def test_traced_scale_names_the_argument():
    q, k, v = _arrays((1, 8, 8, 2, 2, 4))
    f = jax.jit(lambda q, s: maxattn.dot_product_attention(q, k, v, scale=s, implementation="cpu"))
    with pytest.raises(TypeError, match="`scale` is a traced JAX value.*static_argnames"):
        f(q, 0.5)
    with pytest.raises(ValueError, match="`scale` must be a scalar"):
        maxattn.dot_product_attention(q, k, v, scale=jnp.ones(2))
    with pytest.raises(TypeError, match="`scale` must be a Python float or a scalar array"):
        maxattn.dot_product_attention(q, k, v, scale="0.5")


def test_return_residual_rules():
    q, k, v = _arrays((1, 8, 8, 2, 2, 4))
    with pytest.raises(ValueError, match="`return_residual`.*cannot be combined"):
        maxattn.dot_product_attention(q, k, v, return_residual=True, return_lse=True)
    with pytest.raises(TypeError, match="`return_residual` must be a Python bool"):
        maxattn.dot_product_attention(q, k, v, return_residual=1)


@pytest.mark.parametrize("impl", IMPLS)
def test_out_of_range_lengths_are_clamped(impl):
    """Documented: a length below 0 acts as 0 and above T (S) as T (S), on every backend."""
    q, k, v = _arrays((3, 8, 10, 2, 2, 4), seed=9)
    wild = dict(query_seq_lengths=jnp.array([-3, 20, 5], jnp.int32),
                key_value_seq_lengths=jnp.array([4, -1, 99], jnp.int32))
    tame = dict(query_seq_lengths=jnp.array([0, 8, 5], jnp.int32),
                key_value_seq_lengths=jnp.array([4, 0, 10], jnp.int32))
    got, gaux = maxattn.dot_product_attention(q, k, v, implementation=impl, return_lse=True, return_max_logit=True,
                                              **wild)
    want, waux = maxattn.dot_product_attention(q, k, v, implementation="xla", return_lse=True,
                                               return_max_logit=True, **tame)
    np.testing.assert_array_equal(np.isfinite(gaux["lse"]), np.isfinite(waux["lse"]))
    _close(got, want, "out")
    _close(jnp.where(jnp.isfinite(waux["lse"]), gaux["lse"], 0), jnp.where(jnp.isfinite(waux["lse"]), waux["lse"], 0),
           "lse")
    np.testing.assert_allclose(gaux["max_logit"], waux["max_logit"], rtol=1e-6)

"""Dropout and softmax types (vanilla / off_by_one / learnable sinks), issue 7.

The CPU kernels draw the same Philox mask as the pure-JAX reference, so the two
are compared exactly (same mask) at docs/contract.md's tolerances.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import maxattn
from maxattn._src import reference
from helpers import (MAX_TOL, OUT_TOL, assert_close, assert_max_logit_close, random_inputs,
                     use_xla_backend_in_key_blocks, x64)

DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16}
HEADS = {"mha": (4, 4), "gqa": (4, 2)}
KEY = jax.random.key(1234)


def _kwargs(feature, sink):
    kw = {}
    if feature in ("dropout", "both"):
        kw.update(dropout_rate=0.3, dropout_rng=KEY)
    if feature in ("learnable", "both"):
        kw.update(softmax_type="learnable", sink_logits=sink)
    if feature == "off_by_one":
        kw.update(softmax_type="off_by_one")
    return kw


def _loss(impl, kw, ct):
    def f(q, k, v, sink):
        kk = dict(kw)
        if "sink_logits" in kk:
            kk["sink_logits"] = sink
        out, aux = maxattn.dot_product_attention(q, k, v, implementation=impl, return_lse=True,
                                                 return_max_logit=True, **kk)
        w = jnp.cos(jnp.arange(out.size, dtype=ct).reshape(out.shape))
        return jnp.sum(out.astype(ct) * w) + jnp.sum(jnp.sin(aux["lse"].astype(ct))), (out, aux)
    return f


@pytest.mark.parametrize("dtype,heads,causal,feature", [
    ("f32", "gqa", True, "both"),
    ("f32", "mha", False, "learnable"),
    ("f32", "gqa", False, "dropout"),
    ("bf16", "mha", True, "dropout"),
    ("bf16", "gqa", True, "off_by_one"),
    ("bf16", "gqa", False, "both"),
])
def test_cpu_matches_reference_with_the_same_mask(dtype, heads, causal, feature):
    dt = DTYPES[dtype]
    N, K = HEADS[heads]
    q, k, v = random_inputs(7, 2, 37, 45 if not causal else 37, N, K, 16, 24, dt)
    sink = jnp.asarray(np.random.default_rng(8).standard_normal(N) * 1.5, jnp.float32)
    kw = dict(_kwargs(feature, sink), is_causal=causal)
    (_, (out, aux)), grads = jax.value_and_grad(_loss("cpu", kw, jnp.float32), argnums=(0, 1, 2, 3),
                                                has_aux=True)(q, k, v, sink)
    with x64():
        kw64 = dict(kw)
        if "sink_logits" in kw64:
            kw64["sink_logits"] = sink.astype(jnp.float64)
        args64 = [jnp.asarray(x, jnp.float64) for x in (q, k, v, sink)]
        (_, (rout, raux)), rgrads = jax.value_and_grad(_loss("xla", kw64, jnp.float64), argnums=(0, 1, 2, 3),
                                                       has_aux=True)(*args64)
        # max_logit ignores dropout and sinks: the plain reference's.
        _, plain = maxattn.dot_product_attention(*args64[:3], is_causal=causal, return_max_logit=True,
                                                implementation="xla")
        rout, rgrads = np.asarray(rout), [np.asarray(g) for g in rgrads]
        rlse, rmx, pmx = np.asarray(raux["lse"]), np.asarray(raux["max_logit"]), np.asarray(plain["max_logit"])
    tol = OUT_TOL[dt]
    assert_close(out, rout, tol, "out")
    assert_close(aux["lse"], rlse, tol, "lse")
    assert_max_logit_close(np.asarray(aux["max_logit"], np.float64), rmx, MAX_TOL[dt])
    np.testing.assert_array_equal(rmx, pmx)
    for name, g, rg in zip(("dq", "dk", "dv"), grads[:3], rgrads[:3]):
        assert_close(np.asarray(g, np.float32), rg, tol, name)
    if kw.get("softmax_type") == "learnable":
        assert_close(grads[3], rgrads[3], tol, "dsink")


@pytest.mark.parametrize("causal", [False, True])
def test_xla_backward_in_key_blocks_keeps_dropout_and_sinks(monkeypatch, causal):
    """The xla backward in 16-key blocks (three, the last partial) against the same backward in
    one block, in float64: the blocks see the dropout mask at their own key positions, the sink
    gradient and the lse cotangent exactly as the whole does."""
    N, K = HEADS["gqa"]
    q, k, v = random_inputs(21, 2, 37, 37 if causal else 45, N, K, 16, 24, jnp.float32)
    sink = np.random.default_rng(22).standard_normal(N) * 1.5
    with x64():
        kw = dict(_kwargs("both", jnp.asarray(sink, jnp.float64)), is_causal=causal)
        args = [jnp.asarray(x, jnp.float64) for x in (q, k, v, sink)]
        grads = {}
        for block in (16, 1 << 20):
            use_xla_backend_in_key_blocks(monkeypatch, block)
            grads[block] = jax.grad(lambda *a: _loss("xla", kw, jnp.float64)(*a)[0], argnums=(0, 1, 2, 3))(*args)
    for name, g, ref in zip(("dq", "dk", "dv", "dsink"), grads[16], grads[1 << 20]):
        np.testing.assert_allclose(np.asarray(g), np.asarray(ref), rtol=1e-10, atol=1e-12, err_msg=name)


def test_lse_cotangent_as_value_columns_alone_or_appended():
    """cudnn.lse_columns, the lse cotangent as extra value columns, on the xla backward in float64
    (with a bias, dropout and learnable sinks): appended to out, dout and value (cuDNN's one-call
    form) and as a backward of their own added to the plain one (its form past 248 value columns)
    both give the gradients of the backward that takes dlse directly."""
    from maxattn._src.backends import cudnn, xla
    from maxattn._src.call import Saved
    from maxattn._src.canonicalize import canonicalize
    N, K = HEADS["gqa"]
    T, S, Hv = 37, 45, 24
    rng = np.random.default_rng(31)
    with x64():
        q, k, v = (jnp.asarray(x, jnp.float64) for x in random_inputs(31, 2, T, S, N, K, 16, Hv, jnp.float32))
        sink = jnp.asarray(rng.standard_normal(N), jnp.float64)
        bias = jnp.asarray(rng.standard_normal((1, N, T, S)), jnp.float64)
        call, _, _ = canonicalize(q, k, v, bias, is_causal=True, dropout_rate=0.3, dropout_rng=KEY,
                                  softmax_type="learnable", sink_logits=sink, return_lse=True)
        fwd = xla.BACKEND.forward(call)
        dout = jnp.asarray(rng.standard_normal(fwd.out.shape))
        dlse = jnp.asarray(rng.standard_normal(fwd.lse.shape))
        whole = xla.BACKEND.backward(call, Saved(fwd.out, fwd.lse, dout, dlse))
        pad_o, pad_do, pad_v = cudnn.lse_columns(dlse, q.shape, v.shape, q.dtype)
        plain = xla.BACKEND.backward(call, Saved(fwd.out, fwd.lse, dout, None))
        term = xla.BACKEND.backward(call.replace(value=pad_v), Saved(pad_o, fwd.lse, pad_do, None))
        cat = lambda a, b: jnp.concatenate([a, b], -1)
        folded = xla.BACKEND.backward(call.replace(value=cat(v, pad_v)),
                                      Saved(cat(fwd.out, pad_o), fwd.lse, cat(dout, pad_do), None))
    def close(x, ref, what):
        # dbias and dsink come back in float32 (the contract's dtypes), the rest in the inputs' float64.
        tol = dict(rtol=1e-9, atol=1e-12) if np.asarray(ref).dtype == np.float64 else dict(rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(x), np.asarray(ref), err_msg=what, **tol)

    for name in ("dq", "dk", "dbias", "dsink"):
        close(np.asarray(getattr(plain, name)) + np.asarray(getattr(term, name)), getattr(whole, name),
              f"{name}: plain + lse term")
        close(getattr(folded, name), getattr(whole, name), f"{name}: folded")
    close(plain.dv, whole.dv, "dv: plain")
    close(folded.dv[..., :Hv], whole.dv, "dv: folded")
    assert np.abs(np.asarray(term.dq)).max() > 1e-3  # the lse term is not negligible here


def test_sink_gradient_matches_finite_differences():
    """f32 CPU gradients (incl. sink) vs float64 central differences of the reference, fixed key."""
    N, K = 2, 1
    q, k, v = random_inputs(11, 1, 13, 17, N, K, 8, 8, jnp.float32)
    sink = jnp.asarray([0.5, -1.0], jnp.float32)
    kw = dict(dropout_rate=0.25, dropout_rng=KEY, softmax_type="learnable", sink_logits=sink, is_causal=True)
    loss = lambda *a: _loss("cpu", kw, jnp.float32)(*a)[0]
    grads = jax.grad(loss, argnums=(0, 1, 2, 3))(q, k, v, sink)
    rng = np.random.default_rng(12)
    with x64():
        kw64 = dict(kw, sink_logits=None)
        f64 = lambda *a: _loss("xla", kw64, jnp.float64)(*a)[0]
        args = [jnp.asarray(x, jnp.float64) for x in (q, k, v, sink)]
        for idx in range(4):
            d = rng.standard_normal(args[idx].shape)
            eps = 1e-5
            plus = list(args)
            minus = list(args)
            plus[idx] = args[idx] + eps * d
            minus[idx] = args[idx] - eps * d
            fd = (float(f64(*plus)) - float(f64(*minus))) / (2 * eps)
            an = float(np.sum(np.asarray(grads[idx], np.float64) * d))
            assert abs(fd - an) <= 1e-4 * max(1.0, abs(fd)), (idx, fd, an)


def test_mean_over_keys_converges_to_no_dropout():
    q, k, v = random_inputs(21, 1, 16, 16, 2, 2, 8, 8, jnp.float32)
    n = 256
    keys = jax.random.split(jax.random.key(5), n)
    run = jax.jit(jax.vmap(lambda key: maxattn.dot_product_attention(
        q, k, v, implementation="cpu", dropout_rate=0.4, dropout_rng=key)))
    outs = np.asarray(run(keys), np.float64)
    ref = np.asarray(maxattn.dot_product_attention(q, k, v, implementation="cpu"), np.float64)
    err2 = np.sum((outs.mean(0) - ref) ** 2)
    expected2 = np.sum(outs.var(0, ddof=1)) / n  # E ||mean - ref||^2 for an unbiased estimator
    assert err2 <= 2.0 * expected2, (err2, expected2)
    assert np.abs(outs[0] - outs[1]).max() > 1e-3  # different keys, different masks


def test_keep_fraction_within_statistical_bounds():
    q, k, _ = random_inputs(0, 2, 64, 96, 4, 4, 8, 8, jnp.float32)
    rate = 0.3
    from maxattn._src.canonicalize import canonicalize
    call = canonicalize(q, k, k, dropout_rate=rate, dropout_rng=KEY).call
    keep = np.asarray(reference.dropout_keep(call))
    m = keep.size
    sigma = np.sqrt(rate * (1 - rate) / m)
    assert abs(keep.mean() - (1 - rate)) <= 5 * sigma
    # Neighbouring queries / heads / batch rows are not copies of each other.
    assert (keep[:, :, 0] != keep[:, :, 1]).mean() > 0.3
    assert (keep[:, 0] != keep[:, 1]).mean() > 0.3
    assert (keep[0] != keep[1]).mean() > 0.3


def test_rate_zero_is_bit_identical_and_dropout_leaves_lse_max_logit():
    q, k, v = random_inputs(3, 2, 40, 40, 4, 2, 16, 16, jnp.float32)
    f = lambda **kw: maxattn.dot_product_attention(q, k, v, implementation="cpu", is_causal=True,
                                                   return_lse=True, return_max_logit=True, **kw)
    base, base_aux = f()
    zero, zero_aux = f(dropout_rate=0.0, dropout_rng=KEY)
    np.testing.assert_array_equal(np.asarray(base), np.asarray(zero))
    np.testing.assert_array_equal(np.asarray(base_aux["lse"]), np.asarray(zero_aux["lse"]))
    drop, drop_aux = f(dropout_rate=0.5, dropout_rng=KEY)
    assert not np.allclose(np.asarray(drop), np.asarray(base))
    np.testing.assert_array_equal(np.asarray(drop_aux["lse"]), np.asarray(base_aux["lse"]))
    np.testing.assert_array_equal(np.asarray(drop_aux["max_logit"]), np.asarray(base_aux["max_logit"]))
    again, _ = f(dropout_rate=0.5, dropout_rng=KEY)
    np.testing.assert_array_equal(np.asarray(drop), np.asarray(again))  # reproducible


def test_bad_arguments():
    q, k, v = random_inputs(4, 1, 8, 8, 2, 2, 8, 8, jnp.float32)
    f = lambda **kw: maxattn.dot_product_attention(q, k, v, **kw)
    for rate in (1.0, 1.5, -0.1, float("nan")):
        with pytest.raises(ValueError, match="dropout_rate"):
            f(dropout_rate=rate, dropout_rng=KEY)
    with pytest.raises(ValueError, match="dropout_rng"):
        f(dropout_rate=0.1)
    with pytest.raises(TypeError, match="dropout_rng"):
        f(dropout_rate=0.1, dropout_rng=jnp.zeros((3,), jnp.int32))
    with pytest.raises(ValueError, match="softmax_type"):
        f(softmax_type="sigmoid")
    with pytest.raises(ValueError, match="sink_logits"):
        f(softmax_type="learnable")
    with pytest.raises(ValueError, match="sink_logits"):
        f(softmax_type="learnable", sink_logits=jnp.zeros((3,), jnp.float32))
    with pytest.raises(ValueError, match="sink_logits"):
        f(sink_logits=jnp.zeros((2,), jnp.float32))


def test_vmap_masks_are_independent_per_instance():
    q, k, v = random_inputs(5, 1, 16, 16, 2, 2, 8, 8, jnp.float32)
    f = lambda qq: maxattn.dot_product_attention(qq, k, v, implementation="cpu", dropout_rate=0.5,
                                                 dropout_rng=KEY)
    out = jax.vmap(f)(jnp.stack([q, q]))
    assert np.abs(np.asarray(out[0] - out[1])).max() > 1e-3
    np.testing.assert_array_equal(np.asarray(out[0]), np.asarray(f(q)))  # instance 0 = folded batch 0
    keys = jax.random.split(KEY, 3)  # a batched key: each instance uses its own key
    g = lambda key: maxattn.dot_product_attention(q, k, v, implementation="cpu", dropout_rate=0.5,
                                                  dropout_rng=key)
    out = jax.vmap(g)(keys)
    for i in range(3):
        np.testing.assert_array_equal(np.asarray(out[i]), np.asarray(g(keys[i])))


def test_sink_on_fully_masked_rows_and_vmapped_sink_gradient():
    q, k, v = random_inputs(6, 2, 8, 8, 2, 2, 8, 8, jnp.float32)
    sink = jnp.asarray([0.7, -0.2], jnp.float32)
    out, aux = maxattn.dot_product_attention(
        q, k, v, implementation="cpu", softmax_type="learnable", sink_logits=sink,
        key_value_seq_lengths=jnp.asarray([0, 8]), return_lse=True)
    np.testing.assert_array_equal(np.asarray(out[0]), 0.0)
    np.testing.assert_allclose(np.asarray(aux["lse"][0]), np.broadcast_to(np.asarray(sink)[:, None], (2, 8)))
    _, aux1 = maxattn.dot_product_attention(q, k, v, implementation="cpu", softmax_type="off_by_one",
                                            key_value_seq_lengths=jnp.asarray([0, 8]), return_lse=True)
    np.testing.assert_array_equal(np.asarray(aux1["lse"][0]), 0.0)
    h = lambda qq, s: jnp.sum(maxattn.dot_product_attention(
        qq, k, v, implementation="cpu", softmax_type="learnable", sink_logits=s) ** 2)
    g_vmap = jax.grad(lambda s: jnp.sum(jax.vmap(h, in_axes=(0, None))(jnp.stack([q, 2 * q]), s)))(sink)
    g_loop = jax.grad(lambda s: h(q, s) + h(2 * q, s))(sink)
    np.testing.assert_allclose(np.asarray(g_vmap), np.asarray(g_loop), rtol=1e-5)
    sinks = jnp.stack([sink, sink + 1])  # batched sinks (per-layer): lax.map path
    outs = jax.vmap(lambda s: maxattn.dot_product_attention(
        q, k, v, implementation="cpu", softmax_type="learnable", sink_logits=s))(sinks)
    np.testing.assert_allclose(np.asarray(outs[1]), np.asarray(maxattn.dot_product_attention(
        q, k, v, implementation="cpu", softmax_type="learnable", sink_logits=sink + 1)), rtol=1e-6)

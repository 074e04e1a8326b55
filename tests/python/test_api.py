"""API contract: return values, spike, masked rows, vmap, jit, remat, bad input."""

from __future__ import annotations

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import maxattn
from helpers import assert_close, assert_max_logit_close, random_inputs, reference64, x64

IMPLS = ["cpu", "xla"]


@pytest.fixture
def qkv():
    return random_inputs(0, 2, 16, 24, 4, 2, 8, 8, jnp.float32)


def test_return_forms(qkv):
    q, k, v = qkv
    out = maxattn.dot_product_attention(q, k, v, implementation="cpu")
    assert isinstance(out, jax.Array) and out.shape == (2, 16, 4, 8)
    out2, aux = maxattn.dot_product_attention(q, k, v, implementation="cpu", return_max_logit=True)
    assert set(aux) == {"max_logit"} and aux["max_logit"].shape == (4,)
    np.testing.assert_array_equal(out, out2)
    _, aux = maxattn.dot_product_attention(q, k, v, implementation="cpu", return_lse=True)
    assert set(aux) == {"lse"} and aux["lse"].shape == (2, 4, 16)


def test_matches_jax_nn(qkv):
    q, k, v = qkv
    for causal in (False, True):
        ours = maxattn.dot_product_attention(q, k, v, is_causal=causal, implementation="cpu")
        theirs = jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla")
        assert_close(ours, theirs, 1e-5, "out vs jax.nn")


@pytest.mark.parametrize("impl", IMPLS)
def test_spike_in_one_batch_row_sets_max_logit(impl):
    q, k, v = random_inputs(1, 4, 8, 8, 2, 2, 16, 16, jnp.float32)
    q = q.at[2, 5, 1].multiply(40.0)  # batch row 2, head 1 only
    _, aux = maxattn.dot_product_attention(q, k, v, implementation=impl, return_max_logit=True)
    _, ref, _ = reference64(q, k, v, None, jnp.zeros((4, 8, 2, 16)), jnp.zeros((4, 2, 8)))
    assert_max_logit_close(aux["max_logit"], ref["max_logit"], 1e-5)
    # Head 1's maximum comes from batch row 2 alone and is far above head 0's.
    assert aux["max_logit"][1] > 5 * abs(aux["max_logit"][0])
    row_max = [maxattn.dot_product_attention(q[b:b + 1], k[b:b + 1], v[b:b + 1], implementation=impl,
                                             return_max_logit=True)[1]["max_logit"][1] for b in range(4)]
    assert aux["max_logit"][1] == max(row_max) == row_max[2]


@pytest.mark.parametrize("impl", IMPLS)
def test_fully_masked_rows_give_zero_and_no_nan(impl):
    q, k, v = random_inputs(2, 2, 6, 6, 2, 1, 8, 8, jnp.float32)
    qlen = jnp.asarray([6, 0], jnp.int32)
    kvlen = jnp.asarray([0, 6], jnp.int32)

    def f(q, k, v):
        out, aux = maxattn.dot_product_attention(q, k, v, query_seq_lengths=qlen, key_value_seq_lengths=kvlen,
                                                 implementation=impl, return_max_logit=True, return_lse=True)
        return out, aux

    out, aux = f(q, k, v)
    assert not np.isnan(np.asarray(out)).any()
    np.testing.assert_array_equal(out, 0.0)  # row 0 has no keys, row 1 no queries
    assert np.isneginf(np.asarray(aux["lse"])).all()
    np.testing.assert_array_equal(aux["max_logit"], -np.inf)
    grads = jax.grad(lambda q, k, v: f(q, k, v)[0].sum(), argnums=(0, 1, 2))(q, k, v)
    for g in grads:
        assert not np.isnan(np.asarray(g)).any()
        np.testing.assert_array_equal(g, 0.0)


@pytest.mark.parametrize("impl", IMPLS)
def test_nan_propagates_into_max_logit(impl):
    q, k, v = random_inputs(3, 1, 4, 4, 2, 2, 4, 4, jnp.float32)
    q = q.at[0, 1, 0, 0].set(jnp.nan)
    _, aux = maxattn.dot_product_attention(q, k, v, implementation=impl, return_max_logit=True)
    assert np.isnan(aux["max_logit"][0]) and np.isfinite(aux["max_logit"][1])


@pytest.mark.parametrize("impl", IMPLS)
def test_max_logit_is_pre_softcap_and_has_no_gradient(impl):
    q, k, v = random_inputs(4, 1, 8, 8, 2, 2, 8, 8, jnp.float32)
    q = q * 10
    _, capped = maxattn.dot_product_attention(q, k, v, logits_soft_cap=1.0, implementation=impl,
                                              return_max_logit=True)
    _, plain = maxattn.dot_product_attention(q, k, v, implementation=impl, return_max_logit=True)
    np.testing.assert_allclose(capped["max_logit"], plain["max_logit"], rtol=1e-6)
    assert plain["max_logit"].max() > 1.0
    g = jax.grad(lambda q: maxattn.dot_product_attention(q, k, v, implementation=impl,
                                                         return_max_logit=True)[1]["max_logit"].sum())(q)
    np.testing.assert_array_equal(g, 0.0)


def test_vmap_gives_each_instance_its_own_max():
    q, k, v = random_inputs(5, 2, 8, 8, 4, 2, 8, 8, jnp.float32)
    qs = jnp.stack([q, 3 * q, -q])
    bias = jnp.asarray(np.random.default_rng(0).standard_normal((3, 1, 4, 8, 8)), jnp.float32)

    def f(q, bias):
        return maxattn.dot_product_attention(q, k, v, bias, implementation="cpu", is_causal=True,
                                             return_max_logit=True, return_lse=True)

    out, aux = jax.vmap(f)(qs, bias)
    assert aux["max_logit"].shape == (3, 4) and aux["lse"].shape == (3, 2, 4, 8)
    for i in range(3):
        o, a = f(qs[i], bias[i])
        assert_close(out[i], o, 1e-6, "vmapped out")
        np.testing.assert_allclose(aux["max_logit"][i], a["max_logit"], rtol=1e-6)
    # Gradients under vmap, including a bias broadcast over the batch.
    g = jax.vmap(jax.grad(lambda q, b: f(q, b)[0].sum(), argnums=(0, 1)))(qs, bias)
    for i in range(3):
        gi = jax.grad(lambda q, b: f(q, b)[0].sum(), argnums=(0, 1))(qs[i], bias[i])
        assert_close(g[0][i], gi[0], 1e-5, "vmapped dq")
        assert_close(g[1][i], gi[1], 1e-5, "vmapped dbias")
    # Nested vmap: mapped axes come first in max_logit.
    nested = jax.vmap(jax.vmap(lambda q: f(q, bias[0])[1]["max_logit"]))(jnp.stack([qs, qs]))
    assert nested.shape == (2, 3, 4)


def test_jit_caches_and_retraces_only_on_new_config(qkv):
    q, k, v = qkv
    traces = []

    @jax.jit
    def f(q, k, v):
        traces.append(1)
        return maxattn.dot_product_attention(q, k, v, implementation="cpu", is_causal=True,
                                             return_max_logit=True)

    a = f(q, k, v)
    b = f(q + 1, k, v)
    assert len(traces) == 1
    f(q[:, :8], k, v)
    assert len(traces) == 2
    eager = maxattn.dot_product_attention(q, k, v, implementation="cpu", is_causal=True, return_max_logit=True)
    assert_close(a[0], eager[0], 1e-6, "jit vs eager")
    assert not np.allclose(a[1]["max_logit"], b[1]["max_logit"])


def test_checkpoint_and_grad(qkv):
    q, k, v = qkv

    def loss(q, k, v):
        return jnp.sum(maxattn.dot_product_attention(q, k, v, implementation="cpu", is_causal=True) ** 2)

    g1 = jax.grad(jax.checkpoint(loss), argnums=(0, 1, 2))(q, k, v)
    g2 = jax.grad(loss, argnums=(0, 1, 2))(q, k, v)
    for a, b in zip(g1, g2):
        assert_close(a, b, 1e-6, "remat grad")


def test_auto_selects_cpu_without_warning(qkv):
    q, k, v = qkv
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = maxattn.dot_product_attention(q, k, v)
    assert_close(out, maxattn.reference(q, k, v), 1e-5, "auto vs reference")


def test_float64_falls_back_with_reason_in_auto_and_raises_when_explicit():
    with x64():
        q, k, v = (x.astype(jnp.float64) for x in random_inputs(6, 1, 4, 4, 1, 1, 4, 4, jnp.float32))
        with pytest.warns(RuntimeWarning, match="float64"):
            out = maxattn.dot_product_attention(q, k, v)
        assert out.dtype == jnp.float64
        with pytest.raises(ValueError, match='implementation="cpu".*float64'):
            maxattn.dot_product_attention(q, k, v, implementation="cpu")


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("shape", [(0, 4, 4), (1, 0, 4), (1, 4, 0)])
def test_empty_dimensions(impl, shape):
    B, T, S = shape
    q, k, v = random_inputs(7, B, T, S, 2, 1, 4, 4, jnp.float32)
    out, aux = maxattn.dot_product_attention(q, k, v, implementation=impl, return_max_logit=True, return_lse=True)
    assert out.shape == (B, T, 2, 4)
    assert aux["lse"].shape == (B, 2, T)
    np.testing.assert_array_equal(aux["max_logit"], -np.inf)
    if T and B:
        np.testing.assert_array_equal(out, 0.0)


def test_large_logits_are_finite():
    q, k, v = random_inputs(8, 1, 8, 8, 1, 1, 4, 4, jnp.float32)
    q = q * 3000.0  # |s| ~ 1e4
    out, aux = maxattn.dot_product_attention(q, k, v, implementation="cpu", return_max_logit=True, return_lse=True)
    _, ref, _ = reference64(q, k, v, None, jnp.zeros(out.shape), jnp.zeros(aux["lse"].shape))
    assert np.isfinite(np.asarray(aux["lse"])).all() and np.isfinite(np.asarray(out)).all()
    assert_close(aux["lse"], ref["lse"], 1e-5, "lse")
    assert_max_logit_close(aux["max_logit"], ref["max_logit"], 1e-5)


# ---------------------------------------------------------------------------
# Bad input: ValueError/TypeError at trace time naming the argument.

def _good():
    q, k, v = random_inputs(9, 2, 4, 6, 4, 2, 8, 8, jnp.float32)
    return dict(query=q, key=k, value=v)


BAD = [
    ("query rank", lambda a: a.update(query=a["query"][0]), ValueError, "query"),
    ("key rank", lambda a: a.update(key=a["key"][..., None]), ValueError, "key"),
    ("batch mismatch", lambda a: a.update(key=a["key"][:1], value=a["value"][:1]), ValueError, "batch"),
    ("S mismatch", lambda a: a.update(value=a["value"][:, :3]), ValueError, "sequence length"),
    ("H mismatch", lambda a: a.update(key=a["key"][..., :4]), ValueError, "head dim"),
    ("N % K", lambda a: a.update(query=a["query"][:, :, :3]), ValueError, "multiple"),
    ("mixed dtypes", lambda a: a.update(key=a["key"].astype(jnp.bfloat16)), TypeError, "same dtype"),
    ("int dtype", lambda a: a.update(query=a["query"].astype(jnp.int32), key=a["key"].astype(jnp.int32),
                                     value=a["value"].astype(jnp.int32)), TypeError, "floating"),
    ("bias not broadcastable", lambda a: a.update(bias=jnp.zeros((3, 4, 6))), ValueError, "bias"),
    ("bias rank", lambda a: a.update(bias=jnp.zeros((1, 2, 4, 4, 6))), ValueError, "bias"),
    ("mask not broadcastable", lambda a: a.update(mask=jnp.ones((5, 6), bool)), ValueError, "mask"),
    ("mask dtype", lambda a: a.update(mask=jnp.ones((4, 6), jnp.float32)), TypeError, "mask"),
    ("q lengths shape", lambda a: a.update(query_seq_lengths=jnp.ones((3,), jnp.int32)), ValueError,
     "query_seq_lengths"),
    ("kv lengths dtype", lambda a: a.update(key_value_seq_lengths=jnp.ones((2,), jnp.float32)), TypeError,
     "key_value_seq_lengths"),
    ("segment shape", lambda a: a.update(q_segment_ids=jnp.ones((2, 5), jnp.int32),
                                         kv_segment_ids=jnp.ones((2, 6), jnp.int32)), ValueError, "q_segment_ids"),
    ("segment missing", lambda a: a.update(q_segment_ids=jnp.ones((2, 4), jnp.int32)), ValueError,
     "kv_segment_ids"),
    ("negative window", lambda a: a.update(local_window_size=(-1, 2)), ValueError, "local_window_size"),
    ("window type", lambda a: a.update(local_window_size=1.5), TypeError, "local_window_size"),
    ("soft cap <= 0", lambda a: a.update(logits_soft_cap=0.0), ValueError, "logits_soft_cap"),
    ("soft cap negative", lambda a: a.update(logits_soft_cap=-1.0), ValueError, "logits_soft_cap"),
    ("implementation", lambda a: a.update(implementation="triton"), ValueError, "implementation"),
    ("alignment", lambda a: a.update(causal_alignment="center"), ValueError, "causal_alignment"),
    ("return flag", lambda a: a.update(return_max_logit=1), TypeError, "return_max_logit"),
    ("lse flag", lambda a: a.update(return_lse="yes"), TypeError, "return_lse"),
    ("causal flag", lambda a: a.update(is_causal=None), TypeError, "is_causal"),
]


@pytest.mark.parametrize("name,mutate,exc,match", BAD, ids=[b[0] for b in BAD])
def test_bad_input_raises_at_trace_time(name, mutate, exc, match):
    args = _good()
    mutate(args)

    def call(*_):
        return maxattn.dot_product_attention(**args)

    with pytest.raises(exc, match=match):
        jax.eval_shape(call)


def test_auto_mode_order_and_fallback(monkeypatch):
    """implementation=None: the platform's backends in order (on a GPU cudnn, then sm90; sm90 first at
    head dims 128 and 256 and for segment ids without max_segments_per_row), the first that can run the call;
    when none can, "xla" with one warning naming every backend's reason."""
    from maxattn._src import api, backends
    from maxattn._src.call import Call, Operands, Options

    assert backends.auto_order("cpu") == ("cpu",) == backends.auto_order("cpu", 128, True)
    for head_dim in (128, 256):
        assert backends.auto_order("gpu", head_dim) == ("sm90", "cudnn") == backends.auto_order("cuda", head_dim)
    for head_dim in (64, None):
        assert backends.auto_order("gpu", head_dim) == ("cudnn", "sm90") == backends.auto_order("cuda", head_dim)
        assert backends.auto_order("gpu", head_dim, dense_segments=True) == ("sm90", "cudnn")
    assert backends.auto_order("tpu") == ()

    def call(head_dim, segments=False, max_segments=0):
        x = jnp.zeros((1, 8, 2, head_dim), jnp.bfloat16)
        ids = jnp.ones((1, 8), jnp.int32) if segments else None
        return Call(Options(scale=1.0, max_segments=max_segments),
                    Operands(query=x, key=x, value=x, q_segment_ids=ids, kv_segment_ids=ids))

    monkeypatch.setattr(api.jax, "default_backend", lambda: "gpu")
    refusals = {}
    monkeypatch.setattr(backends, "unsupported_reason", lambda name, call: refusals.get(name))
    assert api._choose_backend(None, call(128)) == "sm90" == api._choose_backend(None, call(256))
    assert api._choose_backend(None, call(64)) == "cudnn"
    assert api._choose_backend(None, call(64, segments=True)) == "sm90"
    assert api._choose_backend(None, call(64, segments=True, max_segments=2)) == "cudnn"  # its ragged path
    refusals["sm90"] = "not a Hopper GPU (test)"
    assert api._choose_backend(None, call(128)) == "cudnn"
    refusals["cudnn"] = "no soft cap (test)"
    with pytest.warns(RuntimeWarning, match=r'from "sm90" and "cudnn" to "xla".*"sm90": not a Hopper GPU \(test\); '
                                            r'"cudnn": no soft cap \(test\)'):
        assert api._choose_backend(None, call(128)) is None
    monkeypatch.setattr(api.jax, "default_backend", lambda: "tpu")
    assert api._choose_backend(None, call(128)) is None  # no fused backend there: xla, no warning

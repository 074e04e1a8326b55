"""Property-based tests (hypothesis): the CPU backend equals the float64 reference.

Random B, T, S, N, K, H, Hv, dtype, masks (causal + alignment, padding lengths,
segment ids, window, dense boolean mask), bias shapes, soft cap, scale and
return flags -> out, lse, max_logit and the gradients of q, k, v, bias are
compared with `maxattn.reference` evaluated in float64 on the same (rounded)
inputs, at docs/contract.md's tolerances. A second family draws invalid
argument combinations and checks that each raises ValueError/TypeError at
trace time.

Budget: CI runs a fixed number of examples per test (see EXAMPLES below, a few
hundred in all, derandomized so CI is reproducible); set
MAXATTN_HYPOTHESIS_EXAMPLES=<n> to run n examples per test with fresh seeds.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

import maxattn
from helpers import MAX_TOL, OUT_TOL, assert_close, assert_max_logit_close, loss_and_grads, x64
from maxattn._src import reference as reference_lib
from maxattn._src.canonicalize import canonicalize

_ENV = os.environ.get("MAXATTN_HYPOTHESIS_EXAMPLES")
# Per-test example counts in CI (fixed, derandomized); the env var overrides them.
EXAMPLES = {"numerics": 40, "forward": 60, "invalid": 150}


def _settings(kind: str):
    n = int(_ENV) if _ENV else EXAMPLES[kind]
    # Derandomized unless MAXATTN_HYPOTHESIS_FRESH=1: CI explores the same examples every run.
    fresh = os.environ.get("MAXATTN_HYPOTHESIS_FRESH") == "1"
    return settings(max_examples=n, deadline=None, derandomize=not fresh, database=None,
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.filter_too_much])


DTYPES = [jnp.float32, jnp.bfloat16, jnp.float16]


@st.composite
def attention_case(draw, max_len: int = 24):
    """A valid call: arrays (numpy) and keyword arguments."""
    B = draw(st.integers(1, 3))
    T = draw(st.integers(1, max_len))
    S = draw(st.integers(1, max_len))
    K = draw(st.integers(1, 3))
    N = K * draw(st.integers(1, 3))
    H = draw(st.sampled_from([1, 2, 3, 8, 16, 17, 32]))
    Hv = draw(st.sampled_from([1, 4, 8, 15, 16, 24]))
    dtype = draw(st.sampled_from(DTYPES))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    kw: dict = {}
    arrays: dict = dict(
        q=rng.standard_normal((B, T, N, H)), k=rng.standard_normal((B, S, K, H)),
        v=rng.standard_normal((B, S, K, Hv)), bias=None, mask=None)
    if draw(st.booleans()):
        kw["is_causal"] = True
        kw["causal_alignment"] = draw(st.sampled_from(["top_left", "bottom_right"]))
    elif draw(st.booleans()):
        kw["causal_alignment"] = "bottom_right"  # only shifts the window's diagonal
    if draw(st.booleans()):
        kw["query_seq_lengths"] = np.asarray(draw(st.lists(st.integers(0, T), min_size=B, max_size=B)), np.int32)
    if draw(st.booleans()):
        kw["key_value_seq_lengths"] = np.asarray(draw(st.lists(st.integers(0, S), min_size=B, max_size=B)),
                                                 np.int32)
    if draw(st.booleans()):
        nseg = draw(st.integers(1, 3))
        qseg = rng.integers(0, nseg + 1, size=(B, T)).astype(np.int32)
        kvseg = rng.integers(0, nseg + 1, size=(B, S)).astype(np.int32)
        if draw(st.booleans()):  # packed layout: sorted ids
            qseg.sort(axis=1)
            kvseg.sort(axis=1)
        kw["q_segment_ids"], kw["kv_segment_ids"] = qseg, kvseg
    window = draw(st.sampled_from([None, "int", "pair"]))
    if window == "int":
        kw["local_window_size"] = draw(st.integers(0, max_len + 2))
    elif window == "pair":
        kw["local_window_size"] = (draw(st.integers(0, max_len + 2)), draw(st.integers(0, max_len + 2)))
    if draw(st.booleans()):
        shape = [draw(st.sampled_from([1, full])) for full in (B, N, T, S)]
        rank = draw(st.integers(2, 4))  # leading broadcast axes may be dropped
        shape = shape[4 - rank:] if all(d == 1 for d in shape[:4 - rank]) else shape
        arrays["mask"] = rng.random(shape) < draw(st.sampled_from([0.3, 0.7, 0.95]))
    if draw(st.booleans()):
        shape = [draw(st.sampled_from([1, full])) for full in (B, N, T, S)]
        arrays["bias"] = rng.standard_normal(shape) * draw(st.sampled_from([0.5, 3.0]))
    if draw(st.booleans()):
        kw["logits_soft_cap"] = draw(st.sampled_from([0.5, 2.0, 10.0, 50.0]))
    if draw(st.booleans()):
        kw["scale"] = draw(st.sampled_from([0.05, 0.3, 1.0, 2.0]))
    return dict(dtype=dtype, seed=seed, arrays=arrays, kw=kw, dims=(B, T, S, N, K, H, Hv))


def _to_jax(case):
    dt = case["dtype"]
    a = case["arrays"]
    q, k, v = (jnp.asarray(a[n], dt) for n in "qkv")
    bias = None if a["bias"] is None else jnp.asarray(a["bias"], jnp.float32)
    mask = None if a["mask"] is None else jnp.asarray(a["mask"])
    kw = {n: (jnp.asarray(x) if isinstance(x, np.ndarray) else x) for n, x in case["kw"].items()}
    return q, k, v, bias, mask, kw


def _visible_per_row(q, k, v, bias, mask, kw) -> np.ndarray:
    """Number of visible keys of every (b, n, i) row, from the reference's predicate."""
    call = canonicalize(q, k, v, bias, mask, **kw).call
    vis = reference_lib.visibility(call)
    B, T, N, _ = q.shape
    return np.asarray(jnp.broadcast_to(vis, (B, N, T, k.shape[1]))).sum(-1)


def _jitted(fn, kw, **extra):
    """jit(loss_and_grads) with array keyword arguments traced and the rest static."""
    arrs = {n: x for n, x in kw.items() if isinstance(x, jax.Array)}
    static = {n: x for n, x in kw.items() if n not in arrs}

    def run(q, k, v, bias, ct_out, ct_lse, mask, arrs):
        return loss_and_grads(fn, q, k, v, bias, ct_out, ct_lse, mask=mask, **arrs, **static, **extra)

    return jax.jit(run), arrs


def _reference64(q, k, v, bias, mask, ct_out, ct_lse, kw):
    """helpers.reference64, jitted (much faster than op-by-op for fresh shapes)."""
    with x64():
        c = lambda x: None if x is None else jnp.asarray(np.asarray(x, np.float64))
        f, arrs = _jitted(maxattn.reference, kw)
        return jax.tree.map(np.asarray, f(c(q), c(k), c(v), c(bias), c(ct_out), c(ct_lse), mask, arrs))


def _assert_reduced_dbias_close(g, rg, tol, q, k, v, bias, mask, ct_out, ct_lse, kw):
    """dbias of a broadcast bias in bf16/f16, judged against the size of what it sums.

    A bias broadcast over T and S gets the sum of dS over the whole row, and
    sum_j P_ij (dP_ij - D_i) cancels to 0 exactly; what remains is dominated
    by D_i = <dout_i, out_i> formed from the rounded out (as every fused kernel
    does). The rounding error of such a sum scales with the norm of its terms,
    not of its (cancelling) result, so the bar is tol * max(|ref|, |full dS|),
    with the full [B, N, T, S] dS from the float64 reference.
    """
    B, T, N, _ = q.shape
    S = k.shape[1]
    full_bias = jnp.broadcast_to(bias, (B, N, T, S))
    full_ds = _reference64(q, k, v, full_bias, mask, ct_out, ct_lse, kw)[2][3]
    err = np.linalg.norm(np.asarray(g, np.float64) - rg)
    bar = tol * max(np.linalg.norm(rg), np.linalg.norm(full_ds))
    assert err <= bar, f"dbias: error {err:.3g} > {bar:.3g} (tol {tol} of max(|ref|, |full dS|))"


@_settings("numerics")
@given(case=attention_case(), want=st.sampled_from(["both", "max", "lse", "none"]))
def test_cpu_forward_and_grads_match_float64_reference(case, want):
    note(f"dims B,T,S,N,K,H,Hv={case['dims']} dtype={jnp.dtype(case['dtype'])} kw={case['kw']}")
    q, k, v, bias, mask, kw = _to_jax(case)
    dt = case["dtype"]
    B, T, S, N, K, H, Hv = case["dims"]
    rng = np.random.default_rng(case["seed"] + 1)
    ct_out = jnp.asarray(rng.standard_normal((B, T, N, Hv)), jnp.float32)
    ct_lse = jnp.asarray(rng.standard_normal((B, N, T)), jnp.float32)

    f, arrs = _jitted(maxattn.dot_product_attention, kw, implementation="cpu")
    out, aux, grads = f(q, k, v, bias, ct_out, ct_lse, mask, arrs)
    r_out, r_aux, r_grads = _reference64(q, k, v, bias, mask, ct_out, ct_lse, kw)
    tol = OUT_TOL[dt]
    assert out.dtype == q.dtype and out.shape == (B, T, N, Hv)
    assert aux["max_logit"].shape == (N,) and aux["max_logit"].dtype == jnp.float32
    assert aux["lse"].shape == (B, N, T) and aux["lse"].dtype == jnp.float32
    assert_close(out, r_out, tol, "out")
    assert_close(aux["lse"], r_aux["lse"], min(tol, 1e-3) if dt != jnp.float32 else tol, "lse")
    assert_max_logit_close(aux["max_logit"], r_aux["max_logit"], MAX_TOL[dt])
    counts = _visible_per_row(q, k, v, bias, mask, kw)
    # Fully masked rows: output 0, lse -inf, never NaN.
    empty = counts == 0  # [B, N, T]
    np.testing.assert_array_equal(np.asarray(out, np.float32).transpose(0, 2, 1, 3)[empty], 0.0)
    assert np.isneginf(np.asarray(aux["lse"])[empty]).all()
    for name, g, rg in zip(("dq", "dk", "dv", "dbias"), grads, r_grads):
        assert g.shape == rg.shape and g.dtype == (q.dtype if name != "dbias" else bias.dtype), name
        assert not np.isnan(np.asarray(g, np.float32)).any(), f"{name} has NaN"
        if name == "dbias" and dt != jnp.float32 and bias.size < B * N * T * S:
            _assert_reduced_dbias_close(g, rg, tol, q, k, v, bias, mask, ct_out, ct_lse, kw)
        else:
            assert_close(g, rg, tol, name)

    # The return flags select the outputs; the values do not depend on them.
    flags = dict(return_max_logit=want in ("both", "max"), return_lse=want in ("both", "lse"))
    res = maxattn.dot_product_attention(q, k, v, bias, mask, implementation="cpu", **flags, **kw)
    if want == "none":
        np.testing.assert_array_equal(res, out)
    else:
        o2, aux2 = res
        np.testing.assert_array_equal(o2, out)
        assert set(aux2) == {n for n, f in (("max_logit", flags["return_max_logit"]),
                                            ("lse", flags["return_lse"])) if f}
        for n in aux2:
            np.testing.assert_array_equal(aux2[n], aux[n])


@_settings("forward")
@given(case=attention_case(max_len=200))
def test_cpu_forward_longer_sequences(case):
    """Forward only (cheaper), up to several kv and query tiles (96 x 64)."""
    note(f"dims B,T,S,N,K,H,Hv={case['dims']} dtype={jnp.dtype(case['dtype'])} kw={case['kw']}")
    q, k, v, bias, mask, kw = _to_jax(case)
    dt = case["dtype"]
    out, aux = maxattn.dot_product_attention(q, k, v, bias, mask, implementation="cpu",
                                             return_max_logit=True, return_lse=True, **kw)
    with x64():
        c = lambda x: None if x is None else jnp.asarray(np.asarray(x, np.float64))
        arrs = {n: x for n, x in kw.items() if isinstance(x, jax.Array)}
        static = {n: x for n, x in kw.items() if n not in arrs}
        r_out, r_aux = jax.jit(lambda q, k, v, bias, mask, arrs: maxattn.reference(
            q, k, v, bias, mask, return_max_logit=True, return_lse=True, **arrs, **static))(
                c(q), c(k), c(v), c(bias), mask, arrs)
        r_out, r_lse, r_max = (np.asarray(x) for x in (r_out, r_aux["lse"], r_aux["max_logit"]))
    tol = OUT_TOL[dt]
    assert_close(out, r_out, tol, "out")
    assert_close(aux["lse"], r_lse, min(tol, 1e-3) if dt != jnp.float32 else tol, "lse")
    assert_max_logit_close(aux["max_logit"], r_max, MAX_TOL[dt])


# ---------------------------------------------------------------------------
# Invalid combinations: each raises ValueError/TypeError naming the argument.
# ---------------------------------------------------------------------------

def _valid_base():
    B, T, S, N, K, H, Hv = 2, 5, 7, 4, 2, 8, 6
    r = np.random.default_rng(0)
    args = dict(query=r.standard_normal((B, T, N, H)).astype(np.float32),
                key=r.standard_normal((B, S, K, H)).astype(np.float32),
                value=r.standard_normal((B, S, K, Hv)).astype(np.float32))
    return (B, T, S, N, K, H, Hv), args


def _mutations():
    """(name, mutate(args) -> None, exception, regex) for every rule of the API."""
    B, T, S, N, K, H, Hv = _valid_base()[0]
    f32, i32 = np.float32, np.int32
    z = np.zeros
    return [
        ("q rank", lambda a, x: a.update(query=z((B, T, N, H, 1), f32)), ValueError, "query.*rank 4.*or 3"),
        ("k rank", lambda a, x: a.update(key=z((B, S, K, H, 1), f32)), ValueError, "key.*rank of `query`"),
        ("v rank", lambda a, x: a.update(value=z((S, K, Hv), f32)), ValueError, "value.*rank of `query`"),
        ("int q", lambda a, x: a.update(query=z((B, T, N, H), i32)), TypeError, "query.*floating"),
        ("mixed dtypes", lambda a, x: a.update(key=a["key"].astype(x.draw(st.sampled_from(
            [np.float16, jnp.bfloat16])))), TypeError, "same dtype"),
        ("batch", lambda a, x: a.update(key=z((B + x.draw(st.integers(1, 3)), S, K, H), f32)),
         ValueError, "batch sizes differ"),
        ("kv len", lambda a, x: a.update(value=z((B, S + 1, K, Hv), f32)), ValueError, "sequence length S"),
        ("kv heads", lambda a, x: a.update(value=z((B, S, K + 1, Hv), f32)), ValueError, "number of heads K"),
        ("head dim", lambda a, x: a.update(key=z((B, S, K, H + x.draw(st.integers(1, 4))), f32)),
         ValueError, "head dim H"),
        ("gqa", lambda a, x: a.update(key=z((B, S, 3, H), f32), value=z((B, S, 3, Hv), f32)),
         ValueError, "multiple of the number of kv heads"),
        ("bias shape", lambda a, x: a.update(bias=z((B, N, T, S + x.draw(st.integers(1, 3))), f32)),
         ValueError, "bias.*broadcastable"),
        ("bias rank", lambda a, x: a.update(bias=z((1, B, N, T, S), f32)), ValueError, "bias.*rank"),
        ("bias int", lambda a, x: a.update(bias=z((B, N, T, S), i32)), TypeError, "bias.*floating"),
        ("mask dtype", lambda a, x: a.update(mask=z((B, 1, T, S), x.draw(st.sampled_from([i32, f32])))),
         TypeError, "mask.*boolean"),
        ("mask shape", lambda a, x: a.update(mask=z((B, N + 1, T, S), bool)), ValueError, "mask.*broadcastable"),
        ("qlen shape", lambda a, x: a.update(query_seq_lengths=z((B + 1,), i32)), ValueError, "query_seq_lengths"),
        ("kvlen dtype", lambda a, x: a.update(key_value_seq_lengths=z((B,), f32)), TypeError,
         "key_value_seq_lengths.*integer"),
        ("kvlen list", lambda a, x: a.update(key_value_seq_lengths=[S] * B), TypeError,
         "key_value_seq_lengths.*array"),
        ("segments alone", lambda a, x: a.update(**{x.draw(st.sampled_from(["q_segment_ids", "kv_segment_ids"])):
                                                    z((B, T), i32)}), ValueError, "given together"),
        ("segment shape", lambda a, x: a.update(q_segment_ids=z((B, T), i32), kv_segment_ids=z((B, T + S), i32)),
         ValueError, "kv_segment_ids"),
        ("scale str", lambda a, x: a.update(scale="1"), TypeError, "scale"),
        ("scale nonfinite", lambda a, x: a.update(scale=x.draw(st.sampled_from([np.inf, -np.inf, np.nan]))),
         ValueError, "scale.*finite"),
        ("causal", lambda a, x: a.update(is_causal=x.draw(st.sampled_from([1, "yes", None]))), TypeError,
         "is_causal"),
        ("alignment", lambda a, x: a.update(causal_alignment=x.draw(st.sampled_from(["top", "BOTTOM_RIGHT", 1]))),
         ValueError, "causal_alignment"),
        ("window neg", lambda a, x: a.update(local_window_size=x.draw(st.sampled_from([-1, (-2, 3), (3, -1)]))),
         ValueError, "local_window_size.*non-negative"),
        ("window type", lambda a, x: a.update(local_window_size=x.draw(st.sampled_from([1.5, (1, 2, 3), "3", True]))),
         TypeError, "local_window_size"),
        ("softcap", lambda a, x: a.update(logits_soft_cap=x.draw(st.sampled_from([0.0, -1.0, np.inf, np.nan]))),
         ValueError, "logits_soft_cap"),
        ("softcap type", lambda a, x: a.update(logits_soft_cap="2"), TypeError, "logits_soft_cap"),
        ("implementation", lambda a, x: a.update(implementation=x.draw(st.sampled_from(["gpu", "CPU", ""]))),
         ValueError, "implementation"),
        ("flag", lambda a, x: a.update(**{x.draw(st.sampled_from(["return_lse", "return_max_logit"])):
                                          x.draw(st.sampled_from([1, "True", None]))}), TypeError, "return_"),
    ]


_MUTATIONS = _mutations()


@_settings("invalid")
@given(data=st.data(), which=st.integers(0, len(_MUTATIONS) - 1),
       impl=st.sampled_from(["cpu", "xla", None]), jit=st.booleans())
def test_invalid_arguments_raise(data, which, impl, jit):
    name, mutate, exc, match = _MUTATIONS[which]
    note(name)
    _, args = _valid_base()
    args["implementation"] = impl
    mutate(args, data)
    q, k, v = args.pop("query"), args.pop("key"), args.pop("value")
    bias, mask = args.pop("bias", None), args.pop("mask", None)
    if jit:
        # Trace-time error: arrays as traced arguments, options static.
        arrs = {n: x for n, x in args.items() if isinstance(x, np.ndarray)}
        static = {n: x for n, x in args.items() if n not in arrs}
        f = jax.jit(lambda q, k, v, bias, mask, arrs: maxattn.dot_product_attention(
            q, k, v, bias, mask, **arrs, **static))
        call = lambda: f(q, k, v, bias, mask, arrs)
    else:
        call = lambda: maxattn.dot_product_attention(q, k, v, bias, mask, **args)
    with pytest.raises(exc, match=match):
        call()

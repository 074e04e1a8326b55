"""Segment ids, dense masks, attention sinks and dropout: one test logic, two backends.

Every test takes the `impl` fixture: "cpu" (runs in normal CI, no GPU) and
"cudnn" (marked `gpu`, skipped without a CUDA GPU; run on the device machine).
The cpu parametrization validates the test logic itself; the cudnn one checks
the cudnn backend against the same float64 oracle at docs/contract.md's tolerances.

Dropout: the cudnn backend draws its mask with cuDNN's own Philox generator, so
its mask differs from the CPU backend's and the reference's. The tests therefore
never assume a mask: they extract it. With value = [V_rand | identity over the
S keys], out[..., Hv_r:] = P * keep / (1 - rate) (the dropped-out attention
probabilities themselves), from which keep = (that != 0); everything else (out,
lse, max_logit, gradients) is then checked against a float64 computation that
applies exactly that mask.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import maxattn
from helpers import (GPU_MARKS, bias_and_cotangents, MAX_TOL, OUT_TOL, assert_close, assert_max_logit_close,
                     loss_and_grads, random_inputs, reference64, x64)


def _cpu_backend_ok() -> bool:
    try:
        from maxattn._src.backends import cpu
    except ImportError:
        return False
    return getattr(cpu, "_maxattn_cpu", None) is not None and jax.default_backend() == "cpu"


BACKENDS = [
    pytest.param("cpu", id="cpu",
                 marks=pytest.mark.skipif(not _cpu_backend_ok(), reason="CPU extension not built or not a CPU host")),
    pytest.param("cudnn", id="cudnn",
                 marks=GPU_MARKS),
]


@pytest.fixture(params=BACKENDS)
def impl(request) -> str:
    return request.param


DT = jnp.bfloat16  # the cudnn backend runs bf16/fp16 only; the cpu backend accepts bf16 too
TOL = OUT_TOL[DT]
MTOL = MAX_TOL[DT]


def _attn(impl):
    def fn(q, k, v, bias, **kw):
        return maxattn.dot_product_attention(q, k, v, bias, implementation=impl, **kw)
    return fn


def _i32(x):
    return jnp.asarray(np.asarray(x), jnp.int32)


def _runs(B, L, pattern):
    """[B, L] int32 segment ids from per-row lists of (id, run length); the rest is padding (id 0)."""
    ids = np.zeros((B, L), np.int32)
    for b, runs in enumerate(pattern):
        pos = 0
        for seg, n in runs:
            ids[b, pos:pos + n] = seg
            pos += n
        assert pos <= L
    return ids


# --------------------------------------------------------------------------------------------------
# Segment ids and dense boolean masks
# --------------------------------------------------------------------------------------------------

_PACKED = [[(1, 40), (2, 50), (3, 30)], [(1, 100), (2, 28)]]  # row 0: 3 segments + 8 padding tokens
_UNEQUAL = [[(1, 1), (2, 130), (3, 60), (4, 100)], [(5, 300)], []]
_REUSE = [[(1, 20), (2, 30), (1, 25), (3, 33), (2, 12)], [(1, 16), (2, 16)] * 4]  # ids reused non-contiguously

# name: (B, T, S, N, K, H, Hv, bias shape or None, kwargs builder(rng) -> dict)
SEG_CASES = {
    "seg_packed": (2, 128, 128, 4, 4, 64, 64, None, lambda rng: dict(
        q_segment_ids=_runs(2, 128, _PACKED), kv_segment_ids=_runs(2, 128, _PACKED))),
    "seg_packed_causal_gqa": (2, 128, 128, 4, 2, 64, 64, None, lambda rng: dict(
        q_segment_ids=_runs(2, 128, _PACKED), kv_segment_ids=_runs(2, 128, _PACKED), is_causal=True)),
    "seg_reuse_h128": (2, 128, 128, 4, 4, 128, 128, None, lambda rng: dict(
        q_segment_ids=_runs(2, 128, _REUSE), kv_segment_ids=_runs(2, 128, _REUSE))),
    "seg_reuse_causal_bias": (2, 128, 128, 4, 2, 64, 64, "1NTS", lambda rng: dict(
        q_segment_ids=_runs(2, 128, _REUSE), kv_segment_ids=_runs(2, 128, _REUSE), is_causal=True)),
    # B = 3: unequal runs (a length-1 run, runs across 128-token tiles), one run, an all-padding row.
    "seg_b3_unequal_causal_h128": (3, 300, 300, 4, 2, 128, 128, None, lambda rng: dict(
        q_segment_ids=_runs(3, 300, _UNEQUAL), kv_segment_ids=_runs(3, 300, _UNEQUAL), is_causal=True)),
    "seg_b3_unequal_causal_h256": (3, 300, 300, 4, 2, 256, 256, None, lambda rng: dict(
        q_segment_ids=_runs(3, 300, _UNEQUAL), kv_segment_ids=_runs(3, 300, _UNEQUAL), is_causal=True)),
    "seg_padding_causal_gqa": (2, 128, 128, 4, 2, 64, 64, None, lambda rng: dict(
        q_segment_ids=_runs(2, 128, _PACKED), kv_segment_ids=_runs(2, 128, _PACKED), is_causal=True,
        query_seq_lengths=[110, 128], key_value_seq_lengths=[128, 70])),
    # Cross attention T != S; q row 1 has a segment (5) with no key: fully masked rows (out 0, lse -inf).
    "seg_cross_bias_B11S": (2, 64, 160, 4, 4, 64, 64, "B11S", lambda rng: dict(
        q_segment_ids=_runs(2, 64, [[(1, 20), (2, 30)], [(1, 32), (5, 32)]]),
        kv_segment_ids=_runs(2, 160, [[(1, 70), (2, 80)], [(1, 100)]]))),
    # Dense masks. B1TS with one fully masked query row.
    "mask_B1TS_gqa": (2, 128, 128, 4, 2, 64, 64, None, lambda rng: dict(
        mask=(rng.random((2, 1, 128, 128)) < 0.7) & (np.arange(128)[None, None, :, None] != 5))),
    "mask_11TS_causal_bias": (2, 128, 128, 4, 4, 64, 64, "1NTS", lambda rng: dict(
        mask=rng.random((1, 1, 128, 128)) < 0.8, is_causal=True)),
    "mask_11TS_segments_padding": (2, 128, 128, 4, 4, 64, 64, None, lambda rng: dict(
        mask=rng.random((1, 1, 128, 128)) < 0.8, q_segment_ids=_runs(2, 128, _PACKED),
        kv_segment_ids=_runs(2, 128, _PACKED), query_seq_lengths=[128, 90], key_value_seq_lengths=[100, 128])),
}


def _sm90_runs_seg(name):
    """Whether the sm90 backend (its own forward and backward) takes a SEG_CASES case."""
    _, _, _, _, _, H, Hv, bias_shape, build = SEG_CASES[name]
    return bias_shape is None and "mask" not in build(np.random.default_rng(0)) and H == Hv and H in (64, 128, 256)


def _with_sm90(names, sm90_runs):
    """(impl, name) over BACKENDS, and sm90 for the cases it runs (decided from the case: nothing skipped)."""
    params = [pytest.param(b.values[0], n, marks=b.marks, id=f"{b.id}-{n}") for b in BACKENDS for n in names]
    return params + [pytest.param("sm90", n, marks=GPU_MARKS, id=f"sm90-{n}") for n in names if sm90_runs(n)]


def _seg_backends(names):
    return _with_sm90(names, _sm90_runs_seg)


def _seg_inputs(name, seed=0):
    B, T, S, N, K, H, Hv, bias_shape, build = SEG_CASES[name]
    q, k, v = random_inputs(seed, B, T, S, N, K, H, Hv, DT)
    rng = np.random.default_rng(seed + 100)
    kwargs = {}
    for key, val in build(rng).items():
        if key == "mask":
            kwargs[key] = jnp.asarray(val, jnp.bool_)
        elif key in ("q_segment_ids", "kv_segment_ids", "query_seq_lengths", "key_value_seq_lengths"):
            kwargs[key] = _i32(val)
        else:
            kwargs[key] = val
    bias, ct_out, ct_lse = bias_and_cotangents(rng, B, T, S, N, Hv, bias_shape, DT)
    return q, k, v, bias, ct_out, ct_lse, kwargs


def _check_against(out, aux, grads, r_out, r_aux, r_grads, dtype=DT):
    assert out.dtype == dtype
    assert_close(out, r_out, OUT_TOL[dtype], "out")
    if "lse" in aux:
        assert aux["lse"].dtype == jnp.float32
        assert_close(aux["lse"], r_aux["lse"], OUT_TOL[dtype], "lse")
    if "max_logit" in aux:
        assert aux["max_logit"].dtype == jnp.float32
        assert_max_logit_close(np.asarray(aux["max_logit"], np.float64), r_aux["max_logit"], MAX_TOL[dtype])
    for name, g, rg in grads:
        assert g.shape == rg.shape, name
        assert_close(np.asarray(g, np.float32), rg, OUT_TOL[dtype], name)


@pytest.mark.parametrize("impl, name", _seg_backends(list(SEG_CASES)))
def test_segments_and_masks_match_reference(impl, name):
    q, k, v, bias, ct_out, ct_lse, kwargs = _seg_inputs(name)
    out, aux, grads = jax.jit(lambda *a: loss_and_grads(_attn(impl), *a, **kwargs))(q, k, v, bias, ct_out, ct_lse)
    r_out, r_aux, r_grads = reference64(q, k, v, bias, ct_out, ct_lse, **kwargs)
    _check_against(out, aux, list(zip(("dq", "dk", "dv", "dbias"), grads, r_grads)), r_out, r_aux, r_grads)
    # Fully masked rows (segment-id-0 queries, unmatched segments, all-False mask rows): 0 and -inf, no NaN.
    empty = np.isneginf(r_aux["lse"])  # [B, N, T]
    if empty.any():
        o = np.asarray(out, np.float32).transpose(0, 2, 1, 3)[empty]
        assert np.all(o == 0), "fully masked rows must give output 0"
        assert np.all(np.isneginf(np.asarray(aux["lse"])[empty]))


@pytest.mark.parametrize("impl", BACKENDS + [pytest.param("sm90", marks=GPU_MARKS, id="sm90")])
def test_segments_max_logit_spike_across_and_within_segments(impl):
    """A huge q.k across two segments (and one above the causal diagonal) must not count; a large one
    inside a segment must. Batch row 1 only, three unequal segments."""
    B, T, N, H = 2, 256, 4, 128
    q, k, v = random_inputs(41, B, T, T, N, N, H, H, DT)
    ids = _i32(_runs(B, T, [[(1, 100), (2, 156)], [(1, 1), (2, 200), (3, 55)]]))
    u = np.ones(H, np.float32) / np.sqrt(H)
    qn, kn = np.asarray(q, np.float32), np.asarray(k, np.float32)
    qn[1, 10, 2] = 40 * u    # segment 2; with key 210 (segment 3) or key 20 (after it): not visible
    kn[1, 210, 2] = 40 * u
    kn[1, 20, 2] = 40 * u
    qn[1, 150, 2] = 12 * u   # segment 2, with key 20 (same segment, earlier): logit 480 * scale
    q, k = jnp.asarray(qn, DT), jnp.asarray(kn, DT)
    kwargs = dict(q_segment_ids=ids, kv_segment_ids=ids, is_causal=True)
    out, aux = jax.jit(lambda q, k, v: _attn(impl)(q, k, v, None, return_max_logit=True, return_lse=True,
                                                   **kwargs))(q, k, v)
    with x64():
        r_out, r_aux = maxattn.reference(*(jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v)),
                                         return_max_logit=True, return_lse=True, **kwargs)
    assert_close(out, np.asarray(r_out), TOL, "out")
    assert_max_logit_close(np.asarray(aux["max_logit"], np.float64), np.asarray(r_aux["max_logit"]), MTOL)
    mx = float(aux["max_logit"][2])
    assert 400 * H ** -0.5 < mx < 1000 * H ** -0.5, mx


@pytest.mark.parametrize("impl, name", _seg_backends(["seg_packed_causal_gqa", "seg_cross_bias_B11S",
                                                      "mask_11TS_causal_bias"]))
def test_segments_and_masks_plain_output_grads(impl, name):
    """No aux outputs requested (the plain forward graph) and gradients of <out, ct> alone."""
    q, k, v, bias, ct_out, _, kwargs = _seg_inputs(name, seed=31)
    argnums = (0, 1, 2, 3) if bias is not None else (0, 1, 2)

    def loss(q, k, v, bias):
        out = _attn(impl)(q, k, v, bias, **kwargs)
        return jnp.sum(out.astype(jnp.float32) * ct_out), out

    grads, out = jax.jit(jax.grad(loss, argnums=argnums, has_aux=True))(q, k, v, bias)
    zero_lse = jnp.zeros((q.shape[0], q.shape[2], q.shape[1]), jnp.float32)
    r_out, _, r_grads = reference64(q, k, v, bias, ct_out, zero_lse, **kwargs)
    _check_against(out, {}, list(zip(("dq", "dk", "dv", "dbias"), grads, r_grads)), r_out, None, r_grads)


# --------------------------------------------------------------------------------------------------
# Attention sinks: softmax_type="off_by_one" / "learnable"
# --------------------------------------------------------------------------------------------------

# name: (B, T, S, N, K, H, Hv, softmax_type, sink_logits or None, bias shape, kwargs)
# Head 2 of the learnable cases has sink +8, above every logit of that head (asserted below), so a
# max_logit that wrongly includes the sink shows up as 8.
SINK_CASES = {
    "off_by_one": (2, 128, 128, 4, 4, 64, 64, "off_by_one", None, None, {}),
    "off_by_one_causal_bias_gqa": (2, 128, 128, 4, 2, 64, 64, "off_by_one", None, "1NTS", {"is_causal": True}),
    "learnable_causal_gqa": (2, 128, 128, 4, 2, 64, 64, "learnable", [-1.0, 0.5, 8.0, 2.0], None,
                             {"is_causal": True}),
    # Batch row 1 has no keys at all: out 0 and lse = sink there; padded query rows likewise.
    "learnable_padding_causal": (2, 128, 128, 4, 4, 128, 128, "learnable", [0.3, -2.0, 8.0, 1.0], None,
                                 {"is_causal": True, "query_seq_lengths": [128, 50],
                                  "key_value_seq_lengths": [90, 0]}),
    "learnable_segments": (2, 128, 128, 4, 2, 64, 64, "learnable", [1.5, -0.5, 8.0, 0.0], None,
                           {"q_segment_ids": _runs(2, 128, _PACKED), "kv_segment_ids": _runs(2, 128, _PACKED)}),
}

# (return_max_logit, return_lse): the backends have different internal paths for each.
SINK_PATHS = {"max_lse": (True, True), "max_only": (True, False), "lse_only": (False, True), "plain": (False, False)}


def _sink_inputs(name, seed=0):
    B, T, S, N, K, H, Hv, softmax_type, sink, bias_shape, kw = SINK_CASES[name]
    q, k, v = random_inputs(seed, B, T, S, N, K, H, Hv, DT)
    rng = np.random.default_rng(seed + 200)
    kwargs = {key: (_i32(val) if ("lengths" in key or "segment" in key) else val) for key, val in kw.items()}
    kwargs["softmax_type"] = softmax_type
    sink = None if sink is None else jnp.asarray(sink, jnp.float32)
    bias, ct_out, ct_lse = bias_and_cotangents(rng, B, T, S, N, Hv, bias_shape, DT)
    return q, k, v, bias, sink, ct_out, ct_lse, kwargs


def _sink_loss_and_grads(fn, q, k, v, bias, sink, ct_out, ct_lse, want_max, want_lse, **kwargs):
    """out, aux, {name: grad} of <out, ct_out> (+ <finite lse, ct_lse> when lse is returned)."""
    names = ["dq", "dk", "dv"] + (["dbias"] if bias is not None else []) + (["dsink"] if sink is not None else [])

    def f(*diff):
        q, k, v = diff[:3]
        rest = list(diff[3:])
        b = rest.pop(0) if bias is not None else None
        kw = dict(kwargs)
        if sink is not None:
            kw["sink_logits"] = rest.pop(0)
        res = fn(q, k, v, b, return_max_logit=want_max, return_lse=want_lse, **kw)
        out, aux = res if (want_max or want_lse) else (res, {})
        loss = jnp.sum(out.astype(ct_out.dtype) * ct_out)
        if want_lse:
            lse = aux["lse"]
            loss = loss + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * ct_lse.astype(lse.dtype))
        return loss, (out, aux)

    args = [q, k, v] + ([bias] if bias is not None else []) + ([sink] if sink is not None else [])
    grads, (out, aux) = jax.grad(f, argnums=tuple(range(len(args))), has_aux=True)(*args)
    return out, aux, dict(zip(names, grads))


def _sink_reference64(q, k, v, bias, sink, ct_out, ct_lse, **kwargs):
    with x64():
        cast = lambda x: None if x is None else jnp.asarray(np.asarray(x, np.float64))
        out, aux, grads = _sink_loss_and_grads(maxattn.reference, cast(q), cast(k), cast(v), cast(bias), cast(sink),
                                               cast(ct_out), cast(ct_lse), True, True, **kwargs)
        return jax.tree.map(np.asarray, (out, aux, grads))


def _sm90_runs_sink(name):
    """Whether the sm90 backend (sinks in its epilogue; dsink in its backward's pre-pass at H 64/128)
    takes a SINK_CASES case."""
    _, _, _, _, _, H, Hv, _, _, bias_shape, _ = SINK_CASES[name]
    return bias_shape is None and H == Hv


@pytest.mark.parametrize("path", list(SINK_PATHS))
@pytest.mark.parametrize("impl, name", _with_sm90(list(SINK_CASES), _sm90_runs_sink))
def test_sinks_match_reference(impl, name, path):
    want_max, want_lse = SINK_PATHS[path]
    q, k, v, bias, sink, ct_out, ct_lse, kwargs = _sink_inputs(name)
    if not want_lse:
        ct_lse = jnp.zeros_like(ct_lse)
    run = jax.jit(lambda *a: _sink_loss_and_grads(_attn(impl), *a, want_max, want_lse, **kwargs))
    out, aux, grads = run(q, k, v, bias, sink, ct_out, ct_lse)
    r_out, r_aux, r_grads = _sink_reference64(q, k, v, bias, sink, ct_out, ct_lse, **kwargs)
    assert set(aux) == ({"max_logit"} if want_max else set()) | ({"lse"} if want_lse else set())
    assert set(grads) == set(r_grads)
    _check_against(out, aux, [(n, grads[n], r_grads[n]) for n in sorted(grads)], r_out, r_aux, r_grads)

    # The oracle's max_logit excludes the sink: the plain (vanilla) reference's, exactly.
    plain_kw = {key: val for key, val in kwargs.items() if key != "softmax_type"}
    _, r_plain, _ = reference64(q, k, v, bias, ct_out, ct_lse, **plain_kw)
    np.testing.assert_array_equal(r_aux["max_logit"], r_plain["max_logit"])
    if sink is not None:
        # The +8 sink is above every logit of its head, so including it in max_logit cannot pass.
        assert float(sink[2]) > r_aux["max_logit"][2] + 1.0
    if want_lse:
        # Rows without a visible key: lse is the sink logit (0 for off_by_one), finite; output 0.
        rows = np.isneginf(np.asarray(r_plain["lse"]))
        if rows.any():
            s = np.zeros(q.shape[2]) if sink is None else np.asarray(sink, np.float64)
            expect = np.broadcast_to(s[None, :, None], rows.shape)[rows]
            np.testing.assert_allclose(np.asarray(aux["lse"], np.float64)[rows], expect, rtol=1e-6, atol=1e-6)
            assert np.all(np.asarray(out, np.float32).transpose(0, 2, 1, 3)[rows] == 0)


# --------------------------------------------------------------------------------------------------
# Dropout (mask unknown to the test: extracted through identity value columns)
# --------------------------------------------------------------------------------------------------

RATE = 0.2
KEY = jax.random.key(2024)
HV_R = 64  # random value columns; then S identity columns: Hv = HV_R + S (S <= 128, Hv multiple of 8, <= 256)

# name: (B, T, S, N, K, H, kwargs). H == Hv = HV_R + S keeps cuDNN on its most common head dims.
DROPOUT_CASES = {
    "mha": (2, 128, 64, 4, 4, 128, {}),
    "causal_gqa_padding": (2, 64, 64, 4, 2, 128, {"is_causal": True, "query_seq_lengths": [64, 40],
                                                  "key_value_seq_lengths": [64, 50]}),
}


def _dropout_inputs(name, seed=0):
    B, T, S, N, K, H, kw = DROPOUT_CASES[name]
    q, k, v_r = random_inputs(seed, B, T, S, N, K, H, HV_R, DT)
    eye = jnp.broadcast_to(jnp.eye(S, dtype=DT)[None, :, None, :], (B, S, K, S))
    v = jnp.concatenate([v_r, eye], axis=-1)
    kwargs = {key: (_i32(val) if "lengths" in key else val) for key, val in kw.items()}
    rng = np.random.default_rng(seed + 300)
    ct_out = jnp.asarray(rng.standard_normal((B, T, N, v.shape[-1])), jnp.float32)
    ct_lse = jnp.asarray(rng.standard_normal((B, N, T)), jnp.float32)
    return q, k, v, ct_out, ct_lse, kwargs


def _probs64(q, k, **kwargs):
    """float64 attention probabilities P [B, T, N, S] (no dropout) and the visibility of each entry."""
    B, S, K, _ = k.shape
    with x64():
        eye = jnp.broadcast_to(jnp.eye(S, dtype=jnp.float64)[None, :, None, :], (B, S, K, S))
        p = maxattn.reference(jnp.asarray(np.asarray(q, np.float64)), jnp.asarray(np.asarray(k, np.float64)),
                              eye, **kwargs)
        return np.asarray(p)


def _extract(out, S):
    """A = dropped-out probabilities [B, T, N, S] (float64) and the keep mask A != 0."""
    a = np.asarray(out, np.float64)[..., -S:]
    return a, a != 0


def _check_dropped_probs(a, keep, p, rate):
    """A = P * keep / (1 - rate): zero where invisible or dropped, P / (1 - rate) where kept."""
    vis = p > 0
    assert not np.any(keep & ~vis), "nonzero probability at an invisible (masked) position"
    scaled = p / (1.0 - rate)
    assert_close(a[keep], scaled[keep], TOL, "kept probabilities vs P/(1-rate)")
    # Elementwise: a kept entry that is not rescaled (or rescaled twice) is off by 25 %.
    np.testing.assert_allclose(a[keep], scaled[keep], rtol=4e-2, atol=1e-6)
    m = int(vis.sum())
    frac = keep[vis].mean()
    bound = 5.0 * np.sqrt(rate * (1.0 - rate) / m)
    assert abs(frac - (1.0 - rate)) <= bound, f"keep fraction {frac:.4f}, expected {1 - rate} +- {bound:.4f}"
    return vis


def _explicit_mask_reference64(q, k, v, keep, rate, ct_out, ct_lse, **kwargs):
    """float64 out, aux, grads of <out, ct_out> + <finite lse, ct_lse> with out = (P * keep / (1-rate)) @ v."""
    B, S, K, _ = k.shape
    N = q.shape[2]
    with x64():
        cast = lambda x: jnp.asarray(np.asarray(x, np.float64))
        eye = jnp.broadcast_to(jnp.eye(S, dtype=jnp.float64)[None, :, None, :], (B, S, K, S))
        w_keep = cast(keep) / (1.0 - rate)
        ct_out, ct_lse = cast(ct_out), cast(ct_lse)

        def f(q, k, v):
            p, aux = maxattn.reference(q, k, eye, return_lse=True, return_max_logit=True, **kwargs)
            out = jnp.einsum("btns,bsnh->btnh", p * w_keep, jnp.repeat(v, N // K, axis=2))
            lse = aux["lse"]
            loss = jnp.sum(out * ct_out) + jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * ct_lse)
            return loss, (out, aux)

        grads, (out, aux) = jax.grad(f, argnums=(0, 1, 2), has_aux=True)(cast(q), cast(k), cast(v))
        return jax.tree.map(np.asarray, (out, aux, grads))


@pytest.mark.parametrize("name", list(DROPOUT_CASES))
def test_dropout_extracted_mask_forward_and_grads(impl, name):
    q, k, v, ct_out, ct_lse, kwargs = _dropout_inputs(name)
    S = k.shape[1]
    kw = dict(kwargs, dropout_rate=RATE, dropout_rng=KEY)
    out, aux, grads = jax.jit(lambda *a: loss_and_grads(_attn(impl), *a, **kw))(q, k, v, None, ct_out, ct_lse)
    a, keep = _extract(out, S)
    _check_dropped_probs(a, keep, _probs64(q, k, **kwargs), RATE)

    # out (random columns and probability columns), lse, max_logit and grads vs the explicit-mask oracle.
    r_out, r_aux, r_grads = _explicit_mask_reference64(q, k, v, keep, RATE, ct_out, ct_lse, **kwargs)
    assert_close(np.asarray(out, np.float64)[..., :HV_R], r_out[..., :HV_R], TOL, "out[..., :Hv_r] = A @ V_rand")
    _check_against(out, aux, list(zip(("dq", "dk", "dv"), grads, r_grads)), r_out, r_aux, r_grads)

    # lse and max_logit are those without dropout (same backend).
    _, aux0 = _attn(impl)(q, k, v, None, return_lse=True, return_max_logit=True, **kwargs)
    np.testing.assert_allclose(np.asarray(aux["lse"]), np.asarray(aux0["lse"]), rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(np.asarray(aux["max_logit"]), np.asarray(aux0["max_logit"]), rtol=1e-4)


def test_dropout_determinism_keys_and_rate_zero(impl):
    q, k, v, _, _, kwargs = _dropout_inputs("mha", seed=5)
    S = k.shape[1]
    f = jax.jit(lambda q, k, v, key, rate: _attn(impl)(q, k, v, None, dropout_rate=rate, dropout_rng=key,
                                                       return_lse=True, return_max_logit=True, **kwargs),
                static_argnums=4)
    o1, _ = f(q, k, v, KEY, RATE)
    o2, _ = f(q, k, v, KEY, RATE)
    np.testing.assert_array_equal(np.asarray(o1, np.float32), np.asarray(o2, np.float32))  # same key: bitwise
    o3, _ = f(q, k, v, jax.random.key(7), RATE)
    _, m1 = _extract(o1, S)
    _, m3 = _extract(o3, S)
    assert (m1 != m3).mean() > 0.15, "another key must give another mask"
    # Independent across heads and batch rows (expected disagreement 2 r (1 - r) = 0.32).
    assert (m1[:, :, 0] != m1[:, :, 1]).mean() > 0.15
    assert (m1[0] != m1[1]).mean() > 0.15

    # rate 0.0: bit-identical to a call without dropout (both jitted, so the same kernels run).
    base, base_aux = jax.jit(lambda q, k, v: _attn(impl)(q, k, v, None, return_lse=True, return_max_logit=True,
                                                         **kwargs))(q, k, v)
    zero, zero_aux = f(q, k, v, KEY, 0.0)
    np.testing.assert_array_equal(np.asarray(zero, np.float32), np.asarray(base, np.float32))
    np.testing.assert_array_equal(np.asarray(zero_aux["lse"]), np.asarray(base_aux["lse"]))
    np.testing.assert_array_equal(np.asarray(zero_aux["max_logit"]), np.asarray(base_aux["max_logit"]))


def test_dropout_vmap_gives_independent_masks(impl):
    """vmap over inputs with one unbatched key: every instance draws its own mask."""
    q, k, v, _, _, kwargs = _dropout_inputs("mha", seed=9)
    S = k.shape[1]
    qs = jnp.stack([q, q[:, ::-1], (q.astype(jnp.float32) * 0.5).astype(DT)])
    f = lambda qq: _attn(impl)(qq, k, v, None, dropout_rate=RATE, dropout_rng=KEY, **kwargs)
    outs = jax.jit(jax.vmap(f))(qs)
    masks = []
    for i in range(qs.shape[0]):
        a, keep = _extract(outs[i], S)
        _check_dropped_probs(a, keep, _probs64(qs[i], k, **kwargs), RATE)
        masks.append(keep)
    for i in range(len(masks)):
        for j in range(i):
            assert (masks[i] != masks[j]).mean() > 0.15, f"instances {j} and {i} share a dropout mask"


# --------------------------------------------------------------------------------------------------
# Packed rows as ragged sequences: max_segments_per_row
# --------------------------------------------------------------------------------------------------
# "cudnn" runs these as cuDNN ragged sequences (csrc/maxattn/cudnn/ragged.h); "cpu", "xla" and
# "sm90" (whose kernels are exact for any ids; every case here has head dim 64 or 128, where the
# backward is its own) ignore the bound and compute the dense segment-id rule: the same float64
# oracle checks all four.

RAGGED_BACKENDS = BACKENDS + [pytest.param("xla", id="xla"), pytest.param("sm90", marks=GPU_MARKS, id="sm90")]


@pytest.fixture(params=RAGGED_BACKENDS)
def ragged_impl(request) -> str:
    return request.param


def _unequal_runs(rng, L, n, first_id=1, min_len=1):
    """n segments of random unequal lengths (some of length 1) filling most of L, then padding."""
    cuts = np.sort(rng.choice(np.arange(1, L - 4), size=n - 1, replace=False)) if n > 1 else np.array([], int)
    lengths = np.diff(np.concatenate([[0], cuts, [L - 4]]))
    if n >= 4:
        lengths[1] = 1  # a length-1 segment (the rest goes to its neighbour)
        lengths[0] = max(min_len, lengths[0])
    runs, used = [], 0
    for m, length in enumerate(lengths):
        length = int(min(length, L - used))
        if length <= 0:
            break
        runs.append((first_id + m, length))
        used += length
    return runs


def _ragged_ids(seed, B, L, counts):
    """[B, L] ids: row b has counts[b] unequal segments (0 = an all-padding row)."""
    rng = np.random.default_rng(seed)
    return _runs(B, L, [[] if c == 0 else _unequal_runs(rng, L, c) for c in counts])


# name: (B, T, S, N, K, H, Hv, segments per row, M, kwargs). T == S: the query and key rows share
# their segment ids (kv ids = q ids).
RAGGED_CASES = {
    "b1_one_segment": (1, 128, 128, 4, 4, 64, 64, [1], 1, {}),
    "b3_unequal_16": (3, 256, 256, 4, 4, 64, 64, [16, 5, 0], 16, {}),
    "b3_causal_gqa": (3, 256, 256, 8, 2, 128, 128, [7, 16, 1], 16, {"is_causal": True}),
    "b3_causal_bottom_right": (3, 192, 192, 4, 2, 64, 64, [4, 9, 0], 12,
                               {"is_causal": True, "causal_alignment": "bottom_right"}),
    "b2_window_h128": (2, 256, 256, 4, 4, 128, 128, [6, 3], 8, {"local_window_size": (24, 8)}),
    "b2_causal_window_lengths": (2, 192, 192, 4, 2, 64, 64, [5, 8], 8,
                                 {"is_causal": True, "local_window_size": (16, 0),
                                  "query_seq_lengths": [150, 192], "key_value_seq_lengths": [150, 192]}),
    "b3_bound_above_count": (3, 128, 128, 2, 1, 64, 64, [3, 2, 1], 64, {}),
}


def _ragged_inputs(name, seed=0):
    B, T, S, N, K, H, Hv, counts, M, kw = RAGGED_CASES[name]
    q, k, v = random_inputs(seed, B, T, S, N, K, H, Hv, DT)
    ids = _i32(_ragged_ids(seed + 7, B, T, counts))
    kwargs = {key: (_i32(val) if "lengths" in key else val) for key, val in kw.items()}
    kwargs.update(q_segment_ids=ids, kv_segment_ids=ids, max_segments_per_row=M)
    rng = np.random.default_rng(seed + 300)
    _, ct_out, ct_lse = bias_and_cotangents(rng, B, T, S, N, Hv, None, DT)
    return q, k, v, ct_out, ct_lse, kwargs


def _check_ragged(impl, q, k, v, ct_out, ct_lse, kwargs):
    out, aux, grads = jax.jit(lambda *a: loss_and_grads(_attn(impl), *a, **kwargs))(q, k, v, None, ct_out, ct_lse)
    r_out, r_aux, r_grads = reference64(q, k, v, None, ct_out, ct_lse, **kwargs)
    _check_against(out, aux, list(zip(("dq", "dk", "dv"), grads, r_grads)), r_out, r_aux, r_grads)
    # Padding and segment-less rows: out 0, lse -inf, no NaN anywhere.
    empty = np.isneginf(r_aux["lse"])
    if empty.any():
        assert np.all(np.asarray(out, np.float32).transpose(0, 2, 1, 3)[empty] == 0)
        assert np.all(np.isneginf(np.asarray(aux["lse"])[empty]))
    assert not np.isnan(np.asarray(out, np.float32)).any()
    for g in grads:
        assert not np.isnan(np.asarray(g, np.float32)).any()
    return out, aux


@pytest.mark.parametrize("name", list(RAGGED_CASES))
def test_ragged_segments_match_reference(ragged_impl, name):
    _check_ragged(ragged_impl, *_ragged_inputs(name))


def test_ragged_cross_attention_unequal_segment_lengths(ragged_impl):
    """T != S without a band: the m-th query segment attends the m-th key segment, of another length."""
    B, T, S, N, K, H = 3, 96, 160, 4, 2, 64
    q, k, v = random_inputs(5, B, T, S, N, K, H, H, DT)
    q_ids = _runs(B, T, [[(1, 10), (2, 1), (3, 60)], [(4, 96)], [(1, 3), (2, 40)]])
    kv_ids = _runs(B, S, [[(1, 70), (2, 30), (3, 1)], [(4, 100)], [(1, 1), (2, 150)]])
    rng = np.random.default_rng(55)
    _, ct_out, ct_lse = bias_and_cotangents(rng, B, T, S, N, H, None, DT)
    kwargs = dict(q_segment_ids=_i32(q_ids), kv_segment_ids=_i32(kv_ids), max_segments_per_row=4)
    _check_ragged(ragged_impl, q, k, v, ct_out, ct_lse, kwargs)


def test_ragged_max_logit_spike_in_one_segment(ragged_impl):
    """A huge q.k product across two segments must not count; a large one inside a segment must."""
    B, T, N, H = 3, 256, 4, 64
    q, k, v = random_inputs(11, B, T, T, N, N, H, H, DT)
    ids = _ragged_ids(12, B, T, [6, 10, 3])
    row = ids[1]
    long_ids = [i for i in range(1, 11) if (row == i).sum() >= 2][:2]  # two segments of row 1 with 2+ tokens
    starts = [int(np.argmax(row == i)) for i in long_ids]
    u = np.ones(H, np.float32) / np.sqrt(H)
    qn, kn = np.asarray(q, np.float32), np.asarray(k, np.float32)
    qn[1, starts[0], 2] = 40 * u  # with key starts[1] (another segment): logit 1600 * scale, not visible
    kn[1, starts[1], 2] = 40 * u
    qn[1, starts[1] + 1, 2] = 12 * u  # with key starts[1] (same segment, earlier): logit 480 * scale
    q, k = jnp.asarray(qn, DT), jnp.asarray(kn, DT)
    rng = np.random.default_rng(13)
    _, ct_out, ct_lse = bias_and_cotangents(rng, B, T, T, N, H, None, DT)
    kwargs = dict(q_segment_ids=_i32(ids), kv_segment_ids=_i32(ids), max_segments_per_row=16, is_causal=True)
    _, aux = _check_ragged(ragged_impl, q, k, v, ct_out, ct_lse, kwargs)
    mx = float(aux["max_logit"][2])
    assert 400 * H ** -0.5 < mx < 1000 * H ** -0.5, mx


def test_ragged_vmap_folds_into_the_batch(ragged_impl):
    """vmap over stacked inputs with their own segment ids equals the per-instance calls."""
    q, k, v, _, _, kwargs = _ragged_inputs("b3_causal_gqa", seed=3)
    ids2 = _i32(_ragged_ids(99, 3, 256, [2, 11, 0]))
    qs, ids = jnp.stack([q, q[:, ::-1]]), jnp.stack([kwargs["q_segment_ids"], ids2])
    kw = {key: val for key, val in kwargs.items() if "segment_ids" not in key}
    f = lambda qq, ii: _attn(ragged_impl)(qq, k, v, None, q_segment_ids=ii, kv_segment_ids=ii,
                                          return_max_logit=True, return_lse=True, **kw)
    outs, aux = jax.jit(jax.vmap(f))(qs, ids)
    for i in range(2):
        with x64():
            r_out, r_aux = maxattn.reference(*(jnp.asarray(np.asarray(x, np.float64)) for x in (qs[i], k, v)),
                                             q_segment_ids=ids[i], kv_segment_ids=ids[i],
                                             return_max_logit=True, return_lse=True, **kw)
        assert_close(outs[i], np.asarray(r_out), TOL, f"out[{i}]")
        assert_close(aux["lse"][i], np.asarray(r_aux["lse"]), TOL, f"lse[{i}]")
        assert_max_logit_close(np.asarray(aux["max_logit"][i], np.float64), np.asarray(r_aux["max_logit"]), MTOL)


# Rows that break the max_segments promise: id 1 in two runs (row 0), more runs than M = 3 (row 2).
_BROKEN = [[(1, 30), (2, 30), (1, 30)], [(1, 50), (2, 40)], [(1, 20), (2, 20), (3, 20), (4, 20)]]


def test_ragged_broken_rows_are_nan_on_cudnn_and_exact_elsewhere(ragged_impl):
    """The documented contract: cudnn's ragged path poisons (NaN) exactly the rows that break the
    promise and is exact on the others; cpu and xla compute the dense rule on every row."""
    B, T, N, H = 3, 128, 4, 64
    q, k, v = random_inputs(21, B, T, T, N, N, H, H, DT)
    ids = _i32(_runs(B, T, _BROKEN))
    kwargs = dict(q_segment_ids=ids, kv_segment_ids=ids, max_segments_per_row=3)
    out, aux = jax.jit(lambda q, k, v: _attn(ragged_impl)(q, k, v, None, return_max_logit=True, return_lse=True,
                                                          **kwargs))(q, k, v)
    with x64():
        r_out, r_aux = maxattn.reference(*(jnp.asarray(np.asarray(x, np.float64)) for x in (q, k, v)),
                                         return_max_logit=True, return_lse=True, **kwargs)
    out, lse = np.asarray(out, np.float32), np.asarray(aux["lse"])
    r_out, r_lse = np.asarray(r_out), np.asarray(r_aux["lse"])
    if ragged_impl != "cudnn":
        assert_close(out, r_out, TOL, "out")
        assert_close(lse, r_lse, TOL, "lse")
        assert_max_logit_close(np.asarray(aux["max_logit"], np.float64), np.asarray(r_aux["max_logit"]), MTOL)
        return
    for b in (0, 2):
        assert np.isnan(out[b]).all() and np.isnan(lse[b]).all(), f"row {b} breaks the promise: NaN expected"
    assert_close(out[1], r_out[1], TOL, "out[1]")
    assert_close(lse[1], r_lse[1], TOL, "lse[1]")
    assert np.isnan(np.asarray(aux["max_logit"])).all()
    # Gradients of broken rows are zero, of the kept row exact.
    ct = jnp.asarray(np.random.default_rng(3).standard_normal(out.shape), jnp.float32)
    loss = lambda q, k, v: jnp.sum(_attn(ragged_impl)(q, k, v, None, **kwargs).astype(jnp.float32) * ct)
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    zero_lse = jnp.zeros((B, N, T), jnp.float32)
    _, _, r_grads = reference64(q[1:2], k[1:2], v[1:2], None, ct[1:2], zero_lse[1:2],
                                **{key: (val[1:2] if "segment_ids" in key else val) for key, val in kwargs.items()})
    for name, g, rg in zip(("dq", "dk", "dv"), grads, r_grads):
        g = np.asarray(g, np.float32)
        assert np.all(g[[0, 2]] == 0), f"{name} of broken rows must be zero"
        assert_close(g[1:2], rg, TOL, name)


@pytest.mark.parametrize("extra", ["bias", "mask", "dropout", "sink"])
def test_ragged_bound_ignored_with_dense_only_features(impl, extra):
    """With a bias, mask, dropout or sinks the bound is dropped (cudnn warns once) and results stay exact."""
    q, k, v, ct_out, ct_lse, kwargs = _ragged_inputs("b3_causal_gqa", seed=17)
    B, T, N = q.shape[0], q.shape[1], q.shape[2]
    bias = None
    rng = np.random.default_rng(4)
    if extra == "bias":
        bias = jnp.asarray(rng.standard_normal((1, N, T, T)), DT)
    elif extra == "mask":
        kwargs["mask"] = jnp.asarray(rng.random((1, 1, T, T)) < 0.8)
    elif extra == "sink":
        kwargs["softmax_type"] = "off_by_one"
    if extra == "dropout":
        out = _attn(impl)(q, k, v, None, dropout_rate=0.1, dropout_rng=jax.random.key(0), **kwargs)
        assert out.shape == q.shape and not np.isnan(np.asarray(out, np.float32)).any()
        return
    out, aux, grads = jax.jit(lambda *a: loss_and_grads(_attn(impl), *a, **kwargs))(q, k, v, bias, ct_out, ct_lse)
    r_out, r_aux, r_grads = reference64(q, k, v, bias, ct_out, ct_lse, **kwargs)
    _check_against(out, aux, list(zip(("dq", "dk", "dv", "dbias"), grads, r_grads)), r_out, r_aux, r_grads)

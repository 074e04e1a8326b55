"""Sharding (DP / TP) and context parallelism (all-gather, ring) on 8 CPU devices.

Needs 8 devices, i.e. XLA_FLAGS=--xla_force_host_platform_device_count=8 set
before jax initialises. CI runs it as its own invocation:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python -m pytest -q tests/python/test_sharding.py

When this file is collected in a process with fewer devices (e.g. a plain
`pytest tests/python`), the device tests skip and `test_in_subprocess` re-runs
the file in a subprocess with the flag set, so nothing is silently skipped.

The fused path is the C++ cpu backend; these tests fail if its extension is
not built.
"""

from __future__ import annotations

import os
import subprocess
import sys
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

import maxattn
from helpers import assert_close, assert_max_logit_close, loss_and_grads, reference64, x64

NDEV = 8
HAVE_DEVICES = jax.device_count() >= NDEV
needs8 = pytest.mark.skipif(not HAVE_DEVICES, reason="needs 8 devices (see test_in_subprocess)")

try:
    from maxattn import _maxattn_cpu
    del _maxattn_cpu
    HAVE_CPU_EXT = True
except ImportError:
    HAVE_CPU_EXT = False

TOL = 1e-5  # docs/contract.md, "Tolerances the tests use", float32


def test_in_subprocess():
    if HAVE_DEVICES:
        pytest.skip("running in-process (8 devices present)")
    env = dict(os.environ)
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + f" --xla_force_host_platform_device_count={NDEV}").strip()
    env["JAX_PLATFORMS"] = "cpu"
    here = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", __file__],
                          cwd=here, env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]


@pytest.fixture
def impl():
    """The implementation name that goes through the fused (partitioned) path."""
    if not HAVE_CPU_EXT:
        pytest.fail("the maxattn CPU extension is not built: these tests need the real fused backend")
    return "cpu"


def _mesh(dp, cp, tp):
    return Mesh(np.array(jax.devices()[:NDEV]).reshape(dp, cp, tp), ("dp", "cp", "tp"))


def _put(mesh, x, spec):
    return None if x is None else jax.device_put(x, NamedSharding(mesh, spec))


def _collectives(compiled_text: str, op: str) -> list[str]:
    return [line.strip() for line in compiled_text.splitlines() if f" {op}(" in line or f" {op}-start(" in line]


B, T, N, H = 8, 32, 4, 8
HEADS = {"mha": 4, "gqa": 2, "mqa": 1}

# (dp, cp, tp), strategy, load_balanced, heads. Every strategy x load_balanced pair
# appears on two meshes; MHA, GQA (kv heads sharded over tp) and MQA all appear.
CASES = [
    ((8, 1, 1), None, False, "mha"),
    ((8, 1, 1), None, False, "gqa"),
    ((2, 2, 2), None, False, "gqa"),
    ((1, 8, 1), "ring", True, "mha"),
    ((1, 8, 1), "all_gather", False, "gqa"),
    ((2, 2, 2), "ring", False, "gqa"),
    ((2, 2, 2), "all_gather", True, "mha"),
    ((1, 4, 2), "ring", True, "mqa"),
    ((1, 4, 2), "all_gather", False, "gqa"),
    ((2, 4, 1), "ring", False, "gqa"),
    ((2, 4, 1), "all_gather", True, "mha"),
]


def _inputs(seed, K, Hv=H):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, T, N, H)).astype(np.float32)
    k = rng.standard_normal((B, T, K, H)).astype(np.float32)
    v = rng.standard_normal((B, T, K, Hv)).astype(np.float32)
    ct_out = rng.standard_normal((B, T, N, Hv)).astype(np.float32)
    ct_lse = rng.standard_normal((B, N, T)).astype(np.float32)
    return q, k, v, ct_out, ct_lse


def _run_sharded(impl, mesh, q, k, v, ct_out, ct_lse, *, strategy, lb, kw, seq_ids=None):
    """Runs loss_and_grads under jit on the mesh; returns results in natural order and the HLO."""
    cp = mesh.shape["cp"]
    tp = mesh.shape["tp"]
    K = k.shape[2]
    R = (lambda x, a=1: maxattn.reorder_for_load_balancing(x, cp, a)) if lb else (lambda x, a=1: x)
    IR = (lambda x, a=1: maxattn.inverse_reorder_for_load_balancing(x, cp, a)) if lb else (lambda x, a=1: x)
    seq = "cp" if strategy else None
    qs = P("dp", seq, "tp", None)
    kvs = P("dp", seq, "tp" if K % tp == 0 else None, None)
    kw = dict(kw)
    for name in ("q_segment_ids", "kv_segment_ids"):
        if name in kw:
            kw[name] = _put(mesh, R(jnp.asarray(kw[name])), P("dp", seq))
    for name in ("query_seq_lengths", "key_value_seq_lengths"):
        if name in kw:
            kw[name] = _put(mesh, jnp.asarray(kw[name]), P("dp"))
    args = (_put(mesh, R(q), qs), _put(mesh, R(k), kvs), _put(mesh, R(v), kvs), None,
            _put(mesh, R(ct_out), qs), _put(mesh, R(ct_lse, 2), P("dp", "tp", seq)))

    def fn(q, k, v, bias, ct_out, ct_lse):
        return loss_and_grads(maxattn.dot_product_attention, q, k, v, bias, ct_out, ct_lse,
                              implementation=impl, context_parallel=strategy,
                              context_parallel_axis="cp" if strategy else None, load_balanced=lb, **kw)

    jf = jax.jit(fn)
    hlo = jf.lower(*args).compile().as_text()
    out, aux, (dq, dk, dv) = jf(*args)
    res = (IR(out), {"lse": IR(aux["lse"], 2), "max_logit": aux["max_logit"]}, (IR(dq), IR(dk), IR(dv)))
    return res, aux["max_logit"], hlo


def _check(res, ref):
    (out, aux, grads), (rout, raux, rgrads) = res, ref
    assert_close(out, rout, TOL, "out")
    assert_close(aux["lse"], raux["lse"], TOL, "lse")
    assert_max_logit_close(aux["max_logit"], raux["max_logit"], TOL)
    for name, g, rg in zip(("dq", "dk", "dv"), grads, rgrads):
        assert_close(g, rg, TOL, name)


@needs8
@pytest.mark.parametrize("mesh_shape,strategy,lb,heads", CASES,
                         ids=[f"{'x'.join(map(str, m))}-{s or 'nocp'}{'-lb' if lb else ''}-{h}"
                              for m, s, lb, h in CASES])
def test_matches_single_device(impl, mesh_shape, strategy, lb, heads):
    mesh = _mesh(*mesh_shape)
    q, k, v, ct_out, ct_lse = _inputs(sum(mesh_shape) * 7 + len(heads), HEADS[heads])
    kw = dict(is_causal=True)
    res, mx, hlo = _run_sharded(impl, mesh, q, k, v, ct_out, ct_lse, strategy=strategy, lb=lb, kw=kw)
    _check(res, reference64(q, k, v, None, ct_out, ct_lse, **kw))
    # max_logit is sharded like the heads (replicated over dp and cp).
    assert mx.sharding.is_equivalent_to(NamedSharding(mesh, P("tp" if mesh.shape["tp"] > 1 else None)), 1) or \
        mesh.shape["tp"] == 1
    if strategy != "all_gather":
        # DP / TP and ring: q/k/v (and everything else) are never all-gathered.
        assert not _collectives(hlo, "all-gather"), _collectives(hlo, "all-gather")[:3]
    if strategy == "ring":
        assert _collectives(hlo, "collective-permute"), "ring must rotate K/V with collective-permute"
    if strategy == "all_gather":
        gathers = _collectives(hlo, "all-gather")
        assert gathers and all("{'cp'}" in g or "replica_groups" in g for g in gathers)


# Padding lengths and segment ids: all-gather and ring, plain and load balanced
# (the length-aware paths cut the sequence into chunks with shifted lengths).
MASK_CASES = [
    ((2, 4, 1), "all_gather", True, True),
    ((2, 4, 1), "all_gather", False, False),
    ((1, 4, 2), "ring", True, True),
    ((2, 2, 2), "ring", False, False),
]


@needs8
@pytest.mark.parametrize("mesh_shape,strategy,lb,causal", MASK_CASES,
                         ids=[f"{s}{'-lb' if lb else ''}{'-causal' if c else ''}" for _, s, lb, c in MASK_CASES])
def test_lengths_and_segments(impl, mesh_shape, strategy, lb, causal):
    mesh = _mesh(*mesh_shape)
    q, k, v, ct_out, ct_lse = _inputs(11 + lb + 2 * causal, 2)
    rng = np.random.default_rng(5)
    qlen = rng.integers(1, T + 1, size=B).astype(np.int32)
    qlen[0] = 0  # an empty row: out 0, lse -inf
    kvlen = rng.integers(T // 2, T + 1, size=B).astype(np.int32)
    seg = np.sort(rng.integers(1, 4, size=(B, T)), axis=1).astype(np.int32)
    seg[:, -3:] = 0  # padding segment
    kw = dict(is_causal=causal, query_seq_lengths=qlen, key_value_seq_lengths=kvlen,
              q_segment_ids=seg, kv_segment_ids=seg)
    res, _, _ = _run_sharded(impl, mesh, q, k, v, ct_out, ct_lse, strategy=strategy, lb=lb, kw=kw)
    _check(res, reference64(q, k, v, None, ct_out, ct_lse, **kw))


def _spike(q, k, b, t, head, K):
    """A huge logit at (batch b, position t, head) — visible under causal (query t, key t)."""
    q, k = q.copy(), k.copy()
    q[b, t, head] = 0.0
    k[b, t, head // (N // K)] = 0.0
    q[b, t, head, 0] = 40.0
    k[b, t, head // (N // K), 0] = 40.0
    return q, k


@needs8
@pytest.mark.parametrize("mesh_shape,strategy,lb", [((8, 1, 1), None, False), ((1, 8, 1), "ring", True),
                                                     ((2, 4, 1), "all_gather", False)],
                         ids=["dp-shard", "cp-shard-ring-lb", "cp-shard-all-gather"])
def test_spike_on_one_shard(impl, mesh_shape, strategy, lb):
    """A logit spike living on one DP shard (one batch row) or one CP shard (one sequence block)."""
    mesh = _mesh(*mesh_shape)
    K = 2
    q, k, v, _, _ = _inputs(3, K)
    if strategy is None:
        q, k = _spike(q, k, b=5, t=7, head=1, K=K)  # batch row 5 lives on device 5 only
    else:
        q, k = _spike(q, k, b=0, t=T - 3, head=2, K=K)  # in the last sequence chunk
    cp = mesh.shape["cp"]
    R = (lambda x: maxattn.reorder_for_load_balancing(x, cp, 1)) if lb else (lambda x: x)
    seq = "cp" if strategy else None
    args = [_put(mesh, R(x), P("dp", seq, None, None)) for x in (q, k, v)]
    fn = jax.jit(lambda q, k, v: maxattn.dot_product_attention(
        q, k, v, is_causal=True, implementation=impl, return_max_logit=True, context_parallel=strategy,
        context_parallel_axis="cp" if strategy else None, load_balanced=lb)[1]["max_logit"])
    mx = np.asarray(fn(*args), np.float64)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ref = np.asarray(maxattn.reference(q, k, v, is_causal=True, return_max_logit=True)[1]["max_logit"])
    assert mx[1 if strategy is None else 2] > 100.0
    assert_max_logit_close(mx, ref, TOL)


@needs8
def test_sequence_sharding_without_cp_warns(impl):
    mesh = _mesh(1, 8, 1)
    q, k, v, _, _ = _inputs(4, 4)
    args = [_put(mesh, x, P(None, "cp", None, None)) for x in (q, k, v)]
    fn = jax.jit(lambda q, k, v: maxattn.dot_product_attention(q, k, v, implementation=impl))
    with pytest.warns(RuntimeWarning, match="context_parallel is not set"):
        out = fn(*args)
    assert_close(out, maxattn.reference(q, k, v), TOL, "out")


@needs8
def test_cp_errors(impl):
    q, k, v, _, _ = _inputs(1, 4)
    call = maxattn.dot_product_attention
    with pytest.raises(ValueError, match="bias"):
        call(q, k, v, np.zeros((1, 1, T, T), np.float32), implementation=impl, context_parallel="ring",
             context_parallel_axis="cp")
    with pytest.raises(ValueError, match="mask"):
        call(q, k, v, mask=np.ones((T, T), bool), context_parallel="all_gather", context_parallel_axis="cp")
    with pytest.raises(ValueError, match="local_window_size"):
        call(q, k, v, local_window_size=4, context_parallel="ring", context_parallel_axis="cp")
    with pytest.raises(ValueError, match="top_left"):
        call(q, k, v, is_causal=True, causal_alignment="bottom_right", context_parallel="ring",
             context_parallel_axis="cp")
    with pytest.raises(ValueError, match="context_parallel_axis"):
        call(q, k, v, context_parallel="ring")
    with pytest.raises(ValueError, match="context_parallel"):
        call(q, k, v, context_parallel="ulysses", context_parallel_axis="cp")
    with pytest.raises(ValueError, match="load_balanced"):
        call(q, k, v, load_balanced=True)
    mesh = _mesh(1, 8, 1)
    args = [_put(mesh, x, P(None, "cp", None, None)) for x in (q, k, v)]
    with pytest.raises(Exception, match="not an axis of the mesh"):
        jax.jit(lambda q, k, v: call(q, k, v, implementation=impl, context_parallel="ring",
                                     context_parallel_axis="sp"))(*args)


def test_reorder_roundtrip_and_layout():
    x = jnp.arange(2 * 16 * 3).reshape(2, 16, 3)
    r = maxattn.reorder_for_load_balancing(x, 4, axis=1)
    # chunks of 2: rank 0 holds chunks 0 and 7, rank 1 chunks 1 and 6, ...
    np.testing.assert_array_equal(np.asarray(r[0, :, 0]) // 3 // 2, [0, 0, 7, 7, 1, 1, 6, 6, 2, 2, 5, 5, 3, 3, 4, 4])
    np.testing.assert_array_equal(maxattn.inverse_reorder_for_load_balancing(r, 4, axis=1), x)
    with pytest.raises(ValueError, match="divisible"):
        maxattn.reorder_for_load_balancing(x, 3, axis=1)


def test_vmap_through_partitioned_path(impl):
    """vmap folds into the batch outside custom_partitioning; each instance keeps its own max."""
    q, k, v, _, _ = _inputs(9, 2)
    qs, ks, vs = (np.stack([x[:2], 3 * x[2:4]]) for x in (q, k, v))
    f = lambda q, k, v: maxattn.dot_product_attention(q, k, v, is_causal=True, implementation=impl,
                                                      return_max_logit=True)
    out, aux = jax.vmap(f)(qs, ks, vs)
    for i in range(2):
        ro, raux = maxattn.reference(qs[i], ks[i], vs[i], is_causal=True, return_max_logit=True)
        assert_close(out[i], ro, TOL, "out")
        assert_max_logit_close(aux["max_logit"][i], raux["max_logit"], TOL)


@needs8
def test_dropout_and_sinks_sharded_match_unsharded():
    """Issue 7: each (batch, head) shard draws its part of the unsharded call's dropout
    mask (global offsets), and the sink gradient is reduced over the batch shards."""
    mesh = Mesh(np.array(jax.devices()).reshape(4, 2), ("data", "model"))
    rng = np.random.default_rng(70)
    q = jnp.asarray(rng.standard_normal((8, 16, 4, 8)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((8, 16, 2, 8)), jnp.float32)
    sink = jnp.asarray(rng.standard_normal(4), jnp.float32)
    kw = dict(implementation="cpu", dropout_rate=0.3, dropout_rng=jax.random.key(1), softmax_type="learnable")
    f = lambda q, k, s: jnp.sum(maxattn.dot_product_attention(q, k, k, sink_logits=s, **kw) ** 2)
    ref = maxattn.dot_product_attention(q, k, k, sink_logits=sink, **kw)
    gref = jax.grad(f, argnums=(0, 2))(q, k, sink)
    spec = NamedSharding(mesh, P("data", None, "model", None))
    qs, ks = jax.device_put(q, spec), jax.device_put(k, spec)
    out = jax.jit(lambda q, k: maxattn.dot_product_attention(q, k, k, sink_logits=sink, **kw))(qs, ks)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))
    g = jax.jit(jax.grad(f, argnums=(0, 2)))(qs, ks, sink)
    np.testing.assert_allclose(np.asarray(g[0]), np.asarray(gref[0]), rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(np.asarray(g[1]), np.asarray(gref[1]), rtol=1e-5, atol=1e-5)


@needs8
def test_qk_clip_transform_on_a_sharded_mesh():
    """QK-Clip's optax transform under jit with parameters and max logits sharded
    over a (dp, tp) mesh equals the single-device result, with no all-gather."""
    optax = pytest.importorskip("optax")
    from maxattn.qk_clip import qk_clip_transform

    D, N, K, H = 16, 8, 4, 8
    ks = jax.random.split(jax.random.key(3), 4)
    params = {"attn": {
        "query": {"kernel": jax.random.normal(ks[0], (D, N, H)), "bias": jax.random.normal(ks[1], (N, H))},
        "key": {"kernel": jax.random.normal(ks[2], (D, K, H)), "bias": jax.random.normal(ks[3], (K, H))}}}
    updates = jax.tree.map(lambda p: 0.01 * jnp.ones_like(p), params)
    max_logits = {("attn",): jnp.linspace(10.0, 200.0, N)}  # heads on both sides of tau
    tx = qk_clip_transform(threshold=100.0, alpha=0.5)

    def step(u, p, s):
        out, _ = tx.update(u, tx.init(p), p, max_logits=s)
        return optax.apply_updates(p, out)

    expected = jax.jit(step)(updates, params, max_logits)
    mesh = Mesh(np.array(jax.devices()[:NDEV]).reshape(2, 4), ("dp", "tp"))
    head_spec = lambda x: NamedSharding(mesh, P(*([None] * (x.ndim - 2)), "tp", None))
    shard = lambda tree: jax.tree.map(lambda x: jax.device_put(x, head_spec(x)), tree)
    s_sharded = {("attn",): jax.device_put(max_logits[("attn",)], NamedSharding(mesh, P("tp")))}
    compiled = jax.jit(step).lower(shard(updates), shard(params), s_sharded).compile()
    got = compiled(shard(updates), shard(params), s_sharded)
    assert "all-gather" not in compiled.as_text()
    jax.tree.map(lambda a, b: np.testing.assert_array_equal(np.asarray(a), np.asarray(b)), got, expected)
    q_kernel = got["attn"]["query"]["kernel"]
    assert q_kernel.sharding.is_equivalent_to(head_spec(q_kernel), q_kernel.ndim)


BF16_CASES = [((2, 2, 2), None, False, "gqa"), ((2, 4, 1), "ring", True, "mha"),
              ((1, 4, 2), "all_gather", True, "gqa")]


@needs8
@pytest.mark.parametrize("mesh_shape,strategy,lb,heads", BF16_CASES,
                         ids=[f"{'x'.join(map(str, m))}-{s or 'nocp'}{'-lb' if lb else ''}-{h}"
                              for m, s, lb, h in BF16_CASES])
def test_bfloat16_matches_single_device(impl, mesh_shape, strategy, lb, heads):
    """bf16 inputs: sharded results vs the float64 reference on the same rounded inputs (§3 bf16 bars)."""
    mesh = _mesh(*mesh_shape)
    q, k, v, ct_out, ct_lse = _inputs(sum(mesh_shape) * 11 + len(heads), HEADS[heads])
    q, k, v = (jnp.asarray(x, jnp.bfloat16) for x in (q, k, v))
    kw = dict(is_causal=True)
    (out, aux, grads), _, _ = _run_sharded(impl, mesh, q, k, v, ct_out, ct_lse, strategy=strategy, lb=lb, kw=kw)
    rout, raux, rgrads = reference64(q, k, v, None, ct_out, ct_lse, **kw)
    assert out.dtype == jnp.bfloat16
    assert_close(out, rout, 2e-2, "out")
    assert_close(aux["lse"], raux["lse"], 1e-3, "lse")
    assert_max_logit_close(aux["max_logit"], raux["max_logit"], 1e-3)
    for name, g, rg in zip(("dq", "dk", "dv"), grads, rgrads):
        assert_close(g, rg, 2e-2, name)


@needs8
@pytest.mark.parametrize("strategy", ["ring", "all_gather"])
def test_nan_on_one_cp_shard_reaches_max_logit(impl, strategy):
    """A NaN logit on one sequence shard makes that head's global max_logit NaN (DESIGN §1.1)."""
    mesh = _mesh(1, 8, 1)
    q, k, v, _, _ = _inputs(5, 4)
    q[0, 5, 2, 0] = np.nan  # query row 5 lives on the first cp shard; head 2 only
    spec = NamedSharding(mesh, P(None, "cp", None, None))

    @jax.jit
    def f(q, k, v):
        return maxattn.dot_product_attention(q, k, v, is_causal=True, implementation=impl,
                                             context_parallel=strategy, context_parallel_axis="cp",
                                             return_max_logit=True)[1]["max_logit"]

    mx = np.asarray(f(*(jax.device_put(x, spec) for x in (q, k, v))))
    assert np.isnan(mx[2]) and np.isfinite(np.delete(mx, 2)).all(), mx


class _ReducesInKernel:
    """The cpu backend, but returning max_logit [1, N] (the max over its rows) when the call asks
    for it over the batch, as the sm90 kernels do: the partitioner must not reduce it again, the
    vmap fold must ask for rows, and the API must read the one row."""

    def __init__(self, inner):
        self.inner, self.name, self.asked = inner, inner.name, []

    def unsupported_reason(self, call):
        return self.inner.unsupported_reason(call)

    def forward(self, call):
        res = self.inner.forward(call)
        self.asked.append(call.options.max_logit_over_batch)
        if not (call.options.max_logit and call.options.max_logit_over_batch):
            return res
        mx = res.max_logit
        one = jnp.where(jnp.any(jnp.isnan(mx), axis=0, keepdims=True), jnp.nan, jnp.max(mx, axis=0, keepdims=True))
        return res._replace(max_logit=one)

    def backward(self, call, saved):
        return self.inner.backward(call, saved)


@needs8
@pytest.mark.parametrize("mesh_shape,strategy", [((8, 1, 1), None), ((2, 4, 1), "ring"), ((2, 2, 2), None)])
def test_max_logit_reduced_in_the_kernel(impl, monkeypatch, mesh_shape, strategy):
    """A backend that returns max_logit over its batch rows ([1, N]) gives the same global max under
    DP/TP/CP sharding (a spike on one batch shard, a NaN on another) and per instance under vmap."""
    from maxattn._src import backends, stack
    fake = _ReducesInKernel(backends.get(impl))
    real_get = backends.get
    monkeypatch.setattr(backends, "get", lambda name: fake if name == impl else real_get(name))
    stack.fused.cache_clear()
    try:
        mesh = _mesh(*mesh_shape)
        q, k, v, _, _ = _inputs(11, 2)
        q, k = _spike(q, k, b=5, t=7, head=1, K=2)  # batch row 5: the fourth or sixth DP shard
        q[2, 3, 3, 0] = np.nan  # head 3 NaN from batch row 2 only
        seq = "cp" if strategy else None
        args = [_put(mesh, x, P("dp", seq, "tp" if x.shape[2] % mesh.shape["tp"] == 0 else None, None))
                for x in (q, k, v)]
        f = lambda q, k, v: maxattn.dot_product_attention(
            q, k, v, is_causal=True, implementation=impl, return_max_logit=True, context_parallel=strategy,
            context_parallel_axis="cp" if strategy else None)[1]["max_logit"]
        mx = np.asarray(jax.jit(f)(*args), np.float64)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref = np.asarray(maxattn.reference(q, k, v, is_causal=True, return_max_logit=True)[1]["max_logit"])
        assert mx[1] > 100.0 and np.isnan(mx[3]) and np.isnan(ref[3])
        assert_max_logit_close(mx, ref, TOL)
        assert fake.asked and all(fake.asked) == (strategy is None)  # CP blocks ask for rows

        fake.asked.clear()
        qs, ks, vs = (np.stack([x[:4], 2 * x[4:]]) for x in (q, k, v))
        vm = jax.vmap(lambda q, k, v: maxattn.dot_product_attention(q, k, v, is_causal=True, implementation=impl,
                                                                     return_max_logit=True)[1]["max_logit"])
        got = np.asarray(vm(qs, ks, vs), np.float64)
        # custom_vmap traces the call as written (for its result shapes); the rule that runs asks for rows.
        assert fake.asked and fake.asked[-1] is False
        for i in range(2):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                r = maxattn.reference(qs[i], ks[i], vs[i], is_causal=True, return_max_logit=True)[1]["max_logit"]
            assert_max_logit_close(got[i], np.asarray(r), TOL)
    finally:
        stack.fused.cache_clear()


# ----------------------------------------------------------------------------
# Attention sinks and dropout under context parallelism.


def _cp_arrays(mesh, lb, seq_arrays, lse_arrays=(), seq="cp"):
    """Puts [B, T, heads, d] arrays (sequence sharded over cp, heads over tp when divisible) and
    [B, N, T] arrays on the mesh, reordered for load balancing when lb."""
    cp, tp = mesh.shape["cp"], mesh.shape["tp"]
    R = (lambda x, a=1: maxattn.reorder_for_load_balancing(x, cp, a)) if lb else (lambda x, a=1: x)
    put = [_put(mesh, R(x), P("dp", seq, "tp" if x.shape[2] % tp == 0 else None, None)) for x in seq_arrays]
    return put + [_put(mesh, R(x, 2), P("dp", "tp", seq)) for x in lse_arrays]


def _natural(mesh, lb, x, axis=1):
    return maxattn.inverse_reorder_for_load_balancing(x, mesh.shape["cp"], axis) if lb else x


def _sink_loss(call, kw):
    """<out, ct_out> + <lse, ct_lse> and its grads w.r.t. q, k, v and the sink logits."""
    def f(q, k, v, sink, ct_out, ct_lse):
        kk = dict(kw)
        if kk.get("softmax_type") == "learnable":
            kk["sink_logits"] = sink
        out, aux = call(q, k, v, return_lse=True, return_max_logit=True, **kk)
        return jnp.sum(out * ct_out) + jnp.sum(aux["lse"] * ct_lse), (out, aux)
    return jax.grad(f, argnums=(0, 1, 2, 3), has_aux=True)


# (dp, cp, tp), strategy, load_balanced, softmax_type, extra masking. Learnable sinks under both
# strategies with and without load balancing (the fast causal paths); off_by_one on the
# chunk-pair paths (lengths with an empty kv row: lse = sink, out 0; segment ids).
SINK_CASES = [
    ((2, 4, 1), "ring", False, "learnable", None),
    ((1, 4, 2), "ring", True, "learnable", None),
    ((2, 2, 2), "all_gather", False, "learnable", None),
    ((2, 4, 1), "all_gather", True, "learnable", "lengths"),
    ((2, 2, 2), "ring", True, "off_by_one", "lengths"),
    ((1, 4, 2), "all_gather", False, "off_by_one", "segments"),
]


@needs8
@pytest.mark.parametrize("mesh_shape,strategy,lb,softmax,extra", SINK_CASES,
                         ids=[f"{s}{'-lb' if lb else ''}-{t}{'-' + e if e else ''}"
                              for _, s, lb, t, e in SINK_CASES])
def test_sinks_under_cp_match_unsharded(impl, mesh_shape, strategy, lb, softmax, extra):
    """Blocks run the vanilla softmax, the sink joins each row after the merge: out, lse,
    max_logit and the q/k/v/sink gradients equal the unsharded fused call."""
    mesh = _mesh(*mesh_shape)
    q, k, v, ct_out, ct_lse = _inputs(40 + 3 * mesh_shape[1] + lb, 2)
    rng = np.random.default_rng(41)
    sink = (rng.standard_normal(N) * 1.5).astype(np.float32)
    sink[1] = 12.0  # dominates its rows (lse ~ 4 without it)
    kw = dict(is_causal=True, softmax_type=softmax)
    if extra == "lengths":
        kvlen = rng.integers(T // 2, T + 1, size=B).astype(np.int32)
        kvlen[1] = 0  # every query row of batch row 1 sees no key: lse = sink, out 0
        kw.update(query_seq_lengths=rng.integers(1, T + 1, size=B).astype(np.int32),
                  key_value_seq_lengths=kvlen)
    if extra == "segments":
        seg = np.sort(rng.integers(1, 4, size=(B, T)), axis=1).astype(np.int32)
        seg[:, -3:] = 0
        kw.update(is_causal=False, q_segment_ids=seg, kv_segment_ids=seg)
    call = lambda *a, **kk: maxattn.dot_product_attention(*a, implementation=impl, **kk)
    (rgrads, (rout, raux)) = _sink_loss(call, kw)(q, k, v, sink, ct_out, ct_lse)

    cp_kw = dict(kw)
    for name in ("q_segment_ids", "kv_segment_ids"):
        if name in cp_kw:
            r = maxattn.reorder_for_load_balancing(cp_kw[name], mesh.shape["cp"], 1) if lb else cp_kw[name]
            cp_kw[name] = _put(mesh, r, P("dp", "cp"))
    cp_call = lambda *a, **kk: maxattn.dot_product_attention(
        *a, implementation=impl, context_parallel=strategy, context_parallel_axis="cp", load_balanced=lb, **kk)
    qs, ks, vs, cos, cls = _cp_arrays(mesh, lb, (q, k, v, ct_out), (ct_lse,))
    sink_s = _put(mesh, sink, P("tp"))
    grads, (out, aux) = jax.jit(_sink_loss(cp_call, cp_kw))(qs, ks, vs, sink_s, cos, cls)

    assert_close(_natural(mesh, lb, out), rout, TOL, "out")
    assert_close(_natural(mesh, lb, aux["lse"], 2), raux["lse"], TOL, "lse")
    assert_max_logit_close(np.asarray(aux["max_logit"], np.float64), np.asarray(raux["max_logit"], np.float64), TOL)
    for name, g, rg in zip(("dq", "dk", "dv"), grads[:3], rgrads[:3]):
        assert_close(_natural(mesh, lb, g), rg, TOL, name)
    if softmax == "learnable":
        assert_close(grads[3], rgrads[3], TOL, "dsink")
    if extra == "lengths":
        lse1 = np.asarray(_natural(mesh, lb, aux["lse"], 2))[1]
        np.testing.assert_allclose(lse1, np.broadcast_to((sink if softmax == "learnable" else np.zeros(N))[:, None],
                                                         lse1.shape), rtol=1e-6)
        np.testing.assert_array_equal(np.asarray(_natural(mesh, lb, out))[1], 0.0)


DROP_RATE = 0.3


def _dropout_oracle64(q, k, v, keep, sink, causal):
    """out, lse in float64 with an explicit keep mask [B, N, T, S] (and an optional sink)."""
    G = q.shape[2] // k.shape[2]
    s = jnp.einsum("btnh,bsnh->bnts", q, jnp.repeat(k, G, axis=2)) / np.sqrt(q.shape[3])
    if causal:
        s = jnp.where(np.tril(np.ones((s.shape[2], s.shape[3]), bool)), s, -jnp.inf)
    lse = jax.nn.logsumexp(s, axis=-1)
    if sink is not None:
        lse = jnp.logaddexp(lse, sink[None, :, None])
    p = jnp.exp(s - lse[..., None])
    p = jnp.where(keep, p / (1.0 - np.float64(np.float32(DROP_RATE))), 0.0)
    return jnp.einsum("bnts,bsnd->btnd", p, jnp.repeat(v, G, axis=2)), lse


# (dp, cp, tp), strategy, load_balanced, causal, learnable sink.
DROPOUT_CASES = [
    ((2, 4, 1), "ring", False, False, False),
    ((2, 4, 1), "ring", True, True, True),
    ((1, 4, 2), "all_gather", True, True, False),
]


@needs8
@pytest.mark.parametrize("mesh_shape,strategy,lb,causal,with_sink", DROPOUT_CASES,
                         ids=[f"{s}{'-lb' if lb else ''}{'-causal' if c else ''}{'-sink' if w else ''}"
                              for _, s, lb, c, w in DROPOUT_CASES])
def test_dropout_under_cp_matches_its_own_mask(impl, mesh_shape, strategy, lb, causal, with_sink):
    """The mask is read back through identity value columns (q = 0: uniform probabilities),
    then out, lse and the q/k/v(/sink) gradients of a random call with the same key and mesh
    equal a float64 oracle applying that mask: forward and backward use the same mask. The
    mask keeps ~(1 - rate) and differs between (query chunk, key chunk) blocks."""
    mesh = _mesh(*mesh_shape)
    Bd, Td, Nd, Kd = 2, 32, 2, 2
    rng = np.random.default_rng(50 + lb)
    q = rng.standard_normal((Bd, Td, Nd, 8)).astype(np.float32)
    k = rng.standard_normal((Bd, Td, Kd, 8)).astype(np.float32)
    v = rng.standard_normal((Bd, Td, Kd, Td)).astype(np.float32)
    ct_out = rng.standard_normal((Bd, Td, Nd, Td)).astype(np.float32)
    ct_lse = rng.standard_normal((Bd, Nd, Td)).astype(np.float32)
    sink = np.asarray([0.5, -1.0], np.float32)
    kw = dict(is_causal=causal, dropout_rate=DROP_RATE, dropout_rng=jax.random.key(7))
    if with_sink:
        kw["softmax_type"] = "learnable"
    cp_call = lambda *a, **kk: maxattn.dot_product_attention(
        *a, implementation=impl, context_parallel=strategy, context_parallel_axis="cp", load_balanced=lb, **kk)
    sink_s = _put(mesh, sink, P("tp"))

    # 1. The mask: q = 0 and v = one-hot key positions give out[b, i, n, j] = keep * scale * p_i.
    eye = np.broadcast_to(np.eye(Td, dtype=np.float32)[None, :, None, :], (Bd, Td, Kd, Td))
    q0, k0, v0 = _cp_arrays(mesh, lb, (np.zeros_like(q), k, eye))
    kk = dict(kw, sink_logits=sink_s) if with_sink else kw
    probe = np.asarray(_natural(mesh, lb, jax.jit(lambda q, k, v: cp_call(q, k, v, **kk))(q0, k0, v0)))
    cnt = (np.arange(Td) + 1.0) if causal else np.full(Td, float(Td))
    denom = cnt[None, :, None] + (np.exp(sink)[None, None, :] if with_sink else 0.0)  # [1, T, N]
    p_kept = np.float32(1 / (1 - np.float32(DROP_RATE))) / denom
    keep = np.transpose(probe > 0.5 * p_kept[..., None], (0, 2, 1, 3))  # [B, N, T, S]
    vis = np.tril(np.ones((Td, Td), bool)) if causal else np.ones((Td, Td), bool)
    np.testing.assert_allclose(probe, np.where(np.transpose(keep, (0, 2, 1, 3)), p_kept[..., None], 0.0),
                               rtol=1e-5, atol=1e-7)
    assert not keep[..., ~vis].any()
    frac, m = keep[..., vis].mean(), keep[..., vis].size
    assert abs(frac - (1 - DROP_RATE)) <= 5 * np.sqrt(DROP_RATE * (1 - DROP_RATE) / m), frac
    c = Td // (2 * mesh.shape["cp"])  # blocks of the finest chunking: never copies of each other
    blocks = [keep[:, :, a * c:(a + 1) * c, b * c:(b + 1) * c] for a in range(Td // c) for b in range(Td // c)
              if vis[a * c, (b + 1) * c - 1]]
    for i in range(len(blocks)):
        for j in range(i):
            assert (blocks[i] != blocks[j]).mean() > 0.2, (i, j)

    # 2. A random call with the same key and mesh vs the float64 oracle with that mask.
    def loss(call, q, k, v, sink, ct_out, ct_lse, **extra):
        def f(q, k, v, sink):
            e = dict(extra, sink_logits=sink) if with_sink else extra
            out, aux = call(q, k, v, return_lse=True, **e)
            return jnp.sum(out * ct_out) + jnp.sum(aux["lse"] * ct_lse), (out, aux["lse"])
        return jax.grad(f, argnums=(0, 1, 2, 3), has_aux=True)(q, k, v, sink)

    qs, ks, vs, cos, cls = _cp_arrays(mesh, lb, (q, k, v, ct_out), (ct_lse,))
    grads, (out, lse) = jax.jit(lambda *a: loss(cp_call, *a, **kw))(qs, ks, vs, sink_s, cos, cls)
    def call64(q, k, v, return_lse, sink_logits=None):
        out, lse = _dropout_oracle64(q, k, v, keep, sink_logits, causal)
        return out, {"lse": lse}

    with x64():
        args = [jnp.asarray(x, jnp.float64) for x in (q, k, v, sink, ct_out, ct_lse)]
        rgrads, (rout, rlse) = jax.tree.map(np.asarray, loss(call64, *args))
    assert_close(_natural(mesh, lb, out), rout, TOL, "out")
    assert_close(_natural(mesh, lb, lse, 2), rlse, TOL, "lse")
    for name, g, rg in zip(("dq", "dk", "dv"), grads[:3], rgrads[:3]):
        assert_close(_natural(mesh, lb, g), rg, TOL, name)
    if with_sink:
        assert_close(grads[3], rgrads[3], TOL, "dsink")


@needs8
def test_dropout_under_ring_cp_keys(impl):
    """Ring CP with dropout: same key -> identical, another key -> different; the mean over
    64 keys converges to the no-dropout output; rate 0 is bit-identical to no dropout."""
    mesh = _mesh(2, 4, 1)
    q, k, v, _, _ = _inputs(60, 2)
    q, k, v = q[:2], k[:2], v[:2]
    args = _cp_arrays(mesh, True, (q, k, v))
    f = jax.jit(lambda q, k, v, key, rate: maxattn.dot_product_attention(
        q, k, v, is_causal=True, implementation=impl, context_parallel="ring", context_parallel_axis="cp",
        load_balanced=True, dropout_rate=rate, dropout_rng=key), static_argnums=4)
    plain = jax.jit(lambda q, k, v: maxattn.dot_product_attention(
        q, k, v, is_causal=True, implementation=impl, context_parallel="ring", context_parallel_axis="cp",
        load_balanced=True))
    ref = np.asarray(plain(*args), np.float64)
    keys = jax.random.split(jax.random.key(8), 64)
    outs = np.stack([np.asarray(f(*args, key, 0.4), np.float64) for key in keys])
    np.testing.assert_array_equal(np.asarray(f(*args, keys[0], 0.4)), outs[0])
    assert np.abs(outs[0] - outs[1]).max() > 1e-3
    err2 = np.sum((outs.mean(0) - ref) ** 2)
    expected2 = np.sum(outs.var(0, ddof=1)) / len(keys)  # E ||mean - ref||^2 of an unbiased estimator
    assert err2 <= 2.0 * expected2, (err2, expected2)
    np.testing.assert_array_equal(np.asarray(f(*args, keys[0], 0.0)), ref)


@needs8
def test_all_gather_causal_falls_back_to_chunk_pairs(impl, monkeypatch):
    """The fast all-gather causal calls are bottom-right causal with kv lengths, which cuDNN
    refuses together with dropout or segment ids: when the backend refuses them, CP runs the
    chunk-pair path instead, with the same results."""
    from maxattn._src.backends import cpu
    real, refused = cpu.BACKEND.unsupported_reason, []

    def reason(call):
        if call.options.mask.bottom_right and call.operands.kv_seq_lengths is not None:
            refused.append(call.options)
            return "refused for the test"
        return real(call)

    mesh = _mesh(2, 4, 1)
    q, k, v, ct_out, ct_lse = _inputs(70, 2)
    kw = dict(is_causal=True)
    monkeypatch.setattr(cpu.BACKEND, "unsupported_reason", reason)
    res, _, _ = _run_sharded(impl, mesh, q, k, v, ct_out, ct_lse, strategy="all_gather", lb=False, kw=kw)
    assert refused  # so the chunk pairs ran
    _check(res, reference64(q, k, v, None, ct_out, ct_lse, **kw))

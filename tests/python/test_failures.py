"""Failure injection for the CPU backend's FFI targets.

Every way an FFI call can be malformed (a buffer that does not match its
attributes or the other buffers, an attribute outside its range) and a scratch
allocation failure inside the kernels (forced with a test-only hook) must give
the caller a Python exception carrying the reason -- never a crash -- and the
next call must work normally. The targets are called directly with
jax.ffi.ffi_call, bypassing the Python-side validation of maxattn.

(The cuDNN parts of this issue -- graph rejection, workspace allocation on the
device -- are tested with the cuDNN backend, not here.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import maxattn
from helpers import assert_close, random_inputs
from maxattn._src.backends import cpu as cpu_backend
from maxattn._src.canonicalize import canonicalize

pytestmark = pytest.mark.skipif(cpu_backend._maxattn_cpu is None, reason="CPU extension not built")

B, T, S, N, K, H, Hv = 2, 7, 9, 4, 2, 8, 6
F32 = jnp.float32


def _attrs(**over):
    call = canonicalize(jnp.zeros((B, T, N, H)), jnp.zeros((B, S, K, H)), jnp.zeros((B, S, K, Hv))).call
    attrs = call.options.ffi_attributes()
    attrs.update(over)
    return attrs


def _operands(ops):
    # After the nine in ORDER: sink_logits [N] f32 and dropout_seed [4] u32, [0] when absent.
    return [ops[n] for n in ORDER] + [_ph(F32), _ph(jnp.uint32)]


def _ph(dtype=F32):
    return jnp.zeros((0,), dtype)


def _inputs(seed=0, dtype=F32):
    q, k, v = random_inputs(seed, B, T, S, N, K, H, Hv, dtype)
    return dict(q=q, k=k, v=v, bias=_ph(), mask=_ph(jnp.bool_), qlen=_ph(jnp.int32), kvlen=_ph(jnp.int32),
                qseg=_ph(jnp.int32), kvseg=_ph(jnp.int32))


ORDER = ("q", "k", "v", "bias", "mask", "qlen", "kvlen", "qseg", "kvseg")


def _fwd(ops, attrs, out_shape=(B, T, N, Hv), out_dtype=F32, lse_shape=(B, N, T), max_shape=(B, N),
         lse_dtype=F32):
    cpu_backend.register()
    shapes = (jax.ShapeDtypeStruct(out_shape, out_dtype), jax.ShapeDtypeStruct(lse_shape, lse_dtype),
              jax.ShapeDtypeStruct(max_shape, F32))
    res = jax.ffi.ffi_call(cpu_backend.FWD_TARGET, shapes)(*_operands(ops), **attrs)
    return jax.block_until_ready(res)


def _bwd(ops, attrs, saved, grad_shapes=None):
    cpu_backend.register()
    q, k, v = ops["q"], ops["k"], ops["v"]
    grad_shapes = grad_shapes or [(q.shape, q.dtype), (k.shape, k.dtype), (v.shape, v.dtype), ((0,), F32)]
    grad_shapes = list(grad_shapes) + [((0,), F32)]  # dsink
    shapes = tuple(jax.ShapeDtypeStruct(s, d) for s, d in grad_shapes)
    res = jax.ffi.ffi_call(cpu_backend.BWD_TARGET, shapes)(
        *_operands(ops), saved["out"], saved["dout"], saved["lse"], saved["dlse"], **attrs)
    return jax.block_until_ready(res)


def _good_call_works():
    """A normal public call right after a failure gives the right answer."""
    q, k, v = random_inputs(11, B, T, S, N, K, H, Hv, F32)
    out, aux = maxattn.dot_product_attention(q, k, v, is_causal=True, implementation="cpu",
                                             return_max_logit=True, return_lse=True)
    r_out, r_aux = maxattn.reference(q, k, v, is_causal=True, return_max_logit=True, return_lse=True)
    assert_close(out, r_out, 1e-5, "out after a failure")
    np.testing.assert_allclose(aux["max_logit"], r_aux["max_logit"], rtol=1e-5)
    g = jax.grad(lambda q: maxattn.dot_product_attention(q, k, v, implementation="cpu").sum())(q)
    rg = jax.grad(lambda q: maxattn.reference(q, k, v).sum())(q)
    assert_close(g, rg, 1e-5, "dq after a failure")


def _expect_error(fn, *patterns):
    with pytest.raises(Exception) as info:
        fn()
    msg = str(info.value)
    assert not isinstance(info.value, (AssertionError, pytest.fail.Exception)), msg
    for p in patterns:
        assert p in msg, f"{p!r} not in error message: {msg}"
    _good_call_works()
    return msg


# (name, operand overrides, attribute overrides, forward-call overrides, expected message parts)
FORWARD_CASES = [
    ("k dtype", dict(k=lambda o: o["k"].astype(jnp.bfloat16)), {}, {}, ["operand `k`", "element type"]),
    ("q rank", dict(q=lambda o: o["q"][0]), {}, {}, ["rank 4"]),
    ("q int", dict(q=lambda o: o["q"].astype(jnp.int32), k=lambda o: o["k"].astype(jnp.int32),
                   v=lambda o: o["v"].astype(jnp.int32)), {}, dict(out_dtype=jnp.int32),
     ["`q` must be float32, bfloat16 or float16"]),
    ("k heads vs q heads", dict(k=lambda o: jnp.zeros((B, S, 3, H)), v=lambda o: jnp.zeros((B, S, 3, Hv))), {}, {},
     ["num_q_heads (4) must be a multiple of num_kv_heads (3)"]),
    ("v seq len", dict(v=lambda o: jnp.zeros((B, S + 1, K, Hv))), {}, {}, ["operand `v`", "expected"]),
    ("k head dim", dict(k=lambda o: jnp.zeros((B, S, K, H + 1))), {}, {}, ["operand `k`", "expected"]),
    ("out shape", {}, {}, dict(out_shape=(B, T, N, Hv + 1)), ["operand `out`", str([B, T, N, Hv])]),
    ("out dtype", {}, {}, dict(out_dtype=jnp.float16), ["operand `out`", "element type"]),
    ("lse shape", {}, {}, dict(lse_shape=(B, T, N)), ["operand `lse`", str([B, N, T])]),
    ("lse dtype", {}, {}, dict(lse_dtype=jnp.bfloat16), ["operand `lse`", "element type"]),
    ("max_logit shape", {}, {}, dict(max_shape=(N,)), ["operand `max_logit`"]),
    ("bias not broadcastable", dict(bias=lambda o: jnp.zeros((B, N, T, S + 1))), {}, {},
     ["`bias`", "not broadcastable"]),
    ("bias dtype", dict(bias=lambda o: jnp.zeros((B, N, T, S), jnp.bfloat16)), {}, {},
     ["operand `bias`", "element type"]),
    ("mask dtype", dict(mask=lambda o: jnp.zeros((B, 1, T, S), jnp.int32)), {}, {},
     ["operand `mask`", "element type"]),
    ("mask rank", dict(mask=lambda o: jnp.ones((T, S), bool)), {}, {}, ["`mask` must have rank 4"]),
    ("qlen shape", dict(qlen=lambda o: jnp.zeros((B + 1,), jnp.int32)), {}, {},
     ["operand `q_seq_lengths`", str([B])]),
    ("kvlen dtype", dict(kvlen=lambda o: jnp.zeros((B,), jnp.float32)), {}, {},
     ["operand `kv_seq_lengths`", "element type"]),
    ("kvseg shape", dict(qseg=lambda o: jnp.ones((B, T), jnp.int32), kvseg=lambda o: jnp.ones((B, T + 1), jnp.int32)),
     {}, {}, ["operand `kv_segment_ids`", str([B, S])]),
    ("one segment id (core)", dict(qseg=lambda o: jnp.ones((B, T), jnp.int32)), {}, {},
     ["q_segment_ids and kv_segment_ids must be given together"]),
    ("dropout rate without seed", {}, dict(dropout_rate=np.float32(0.5)), {},
     ["`dropout_seed` must be given iff dropout_rate > 0"]),
    ("alignment out of range (core)", {}, dict(alignment=np.int32(5)), {},
     ["alignment (5) must be top-left (0) or bottom-right (1)"]),
    ("window_left", {}, dict(window_left=np.int64(-7)), {}, ["window_left (-7) must be >= 0"]),
    ("window_right", {}, dict(window_right=np.int64(-2)), {}, ["window_right (-2) must be >= 0"]),
    ("softcap inf", {}, dict(softcap=np.float32(np.inf)), {}, ["softcap", "must be finite"]),
    ("softcap nan", {}, dict(softcap=np.float32(np.nan)), {}, ["softcap", "must be finite"]),
]


@pytest.mark.parametrize("name,ops_over,attr_over,call_over,expect", FORWARD_CASES,
                         ids=[c[0] for c in FORWARD_CASES])
def test_forward_target_rejects_mismatch(name, ops_over, attr_over, call_over, expect):
    ops = _inputs()
    for n, f in ops_over.items():
        ops[n] = f(ops)
    # Errors of the glue name the target; the core's own validation messages name the field.
    core = any(w in name for w in ("window", "softcap", "heads vs", "(core)"))
    op = () if core else ("maxattn_attention_fwd_cpu",)
    _expect_error(lambda: _fwd(ops, _attrs(**attr_over), **call_over), *op, *expect)


def test_missing_attribute_is_an_error():
    attrs = _attrs()
    del attrs["softcap"]  # one attribute short
    _expect_error(lambda: _fwd(_inputs(), attrs), "Wrong number of attributes")


def test_wrong_attribute_type_is_an_error():
    # XLA's decoder names the attribute's position and the types.
    _expect_error(lambda: _fwd(_inputs(), _attrs(window_left=np.int32(3))), "expected S64 but got S32")


def _saved():
    ops = _inputs(3)
    out, lse, _ = _fwd(ops, _attrs())
    rng = np.random.default_rng(0)
    return ops, dict(out=out, dout=jnp.asarray(rng.standard_normal(out.shape), F32), lse=lse, dlse=_ph())


BACKWARD_CASES = [
    ("dout shape", dict(dout=lambda s: s["dout"][:, :-1]), None, ["operand `dout`"]),
    ("out dtype", dict(out=lambda s: s["out"].astype(jnp.bfloat16)), None, ["operand `out`", "element type"]),
    ("lse shape", dict(lse=lambda s: s["lse"][..., :-1]), None, ["operand `lse`"]),
    ("lse placeholder", dict(lse=lambda s: _ph()), None, ["operand `lse`"]),
    ("dlse shape", dict(dlse=lambda s: jnp.zeros((B, N, T + 1))), None, ["operand `dlse`"]),
    ("dq shape", {}, [((B, T, N, H + 1), F32), ((B, S, K, H), F32), ((B, S, K, Hv), F32), ((0,), F32)],
     ["operand `dq`"]),
    ("dv dtype", {}, [((B, T, N, H), F32), ((B, S, K, H), F32), ((B, S, K, Hv), jnp.float16), ((0,), F32)],
     ["operand `dv`", "element type"]),
    ("dbias without bias", {}, [((B, T, N, H), F32), ((B, S, K, H), F32), ((B, S, K, Hv), F32), ((B, N, T, S), F32)],
     ["result `dbias` is requested but there is no bias"]),
]


@pytest.mark.parametrize("name,saved_over,grad_shapes,expect", BACKWARD_CASES, ids=[c[0] for c in BACKWARD_CASES])
def test_backward_target_rejects_mismatch(name, saved_over, grad_shapes, expect):
    ops, saved = _saved()
    for n, f in saved_over.items():
        saved[n] = f(saved)
    _expect_error(lambda: _bwd(ops, _attrs(), saved, grad_shapes), "maxattn_attention_bwd_cpu", *expect)


def test_backward_dbias_shape_must_match_bias():
    ops, saved = _saved()
    ops["bias"] = jnp.zeros((1, N, T, S))
    grad_shapes = [((B, T, N, H), F32), ((B, S, K, H), F32), ((B, S, K, Hv), F32), ((B, N, T, S), F32)]
    _expect_error(lambda: _bwd(ops, _attrs(), saved, grad_shapes), "operand `dbias`",
                  str([1, N, T, S]))


# ---------------------------------------------------------------------------
# Scratch allocation failure inside the kernels (test-only hook).
# ---------------------------------------------------------------------------

def _fail_next(n):
    cpu_backend._maxattn_cpu._fail_next_scratch_allocations(n)


@pytest.fixture
def clear_injection():
    yield
    _fail_next(0)


@pytest.mark.parametrize("count", [1, 3, 1000])
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_forward_scratch_allocation_failure(clear_injection, count, dtype):
    q, k, v = random_inputs(5, 3, 200, 150, 4, 2, 16, 16, dtype)  # several tasks on the thread pool
    f = jax.jit(lambda q, k, v: maxattn.dot_product_attention(q, k, v, is_causal=True, implementation="cpu",
                                                              return_max_logit=True))
    good = jax.block_until_ready(f(q, k, v))
    _fail_next(count)
    with pytest.raises(Exception, match="AttentionForwardCpu: out of memory"):
        jax.block_until_ready(f(q, k, v))
    _fail_next(0)
    again = jax.block_until_ready(f(q, k, v))
    np.testing.assert_array_equal(again[0], good[0])
    np.testing.assert_array_equal(again[1]["max_logit"], good[1]["max_logit"])
    _good_call_works()


@pytest.mark.parametrize("with_bias", [False, True])
def test_backward_scratch_allocation_failure(clear_injection, with_bias):
    q, k, v = random_inputs(6, 2, 130, 70, 4, 2, 16, 8, jnp.float32)
    bias = jnp.asarray(np.random.default_rng(1).standard_normal((1, 4, 130, 70)), F32) if with_bias else None
    grad = jax.jit(jax.grad(lambda q, k, v, b: maxattn.dot_product_attention(
        q, k, v, b, implementation="cpu").sum(), argnums=(0, 1, 2)))
    good = jax.block_until_ready(grad(q, k, v, bias))
    # The forward of the VJP allocates too: skip its allocations by failing only in the backward.
    f_vjp = jax.jit(lambda q, k, v, b: jax.vjp(lambda q, k, v: maxattn.dot_product_attention(
        q, k, v, b, implementation="cpu"), q, k, v))
    out, vjp = f_vjp(q, k, v, bias)
    jax.block_until_ready(out)
    bwd = jax.jit(lambda ct: vjp(ct))
    _fail_next(2)
    with pytest.raises(Exception, match="AttentionBackwardCpu: out of memory"):
        jax.block_until_ready(bwd(jnp.ones_like(out)))
    _fail_next(0)
    for g, gg in zip(bwd(jnp.ones_like(out)), good):
        np.testing.assert_allclose(g, gg, rtol=1e-6, atol=1e-7)
    _good_call_works()


def test_many_failures_in_a_row_leave_no_damage(clear_injection):
    """Alternate failing and good calls; the pool and the process stay healthy."""
    q, k, v = random_inputs(9, 2, 100, 100, 2, 1, 8, 8, F32)
    f = jax.jit(lambda q, k, v: maxattn.dot_product_attention(q, k, v, implementation="cpu"))
    good = np.asarray(f(q, k, v))
    for i in range(20):
        _fail_next(1 + i % 4)
        with pytest.raises(Exception, match="out of memory"):
            jax.block_until_ready(f(q, k, v))
        _fail_next(0)
        np.testing.assert_array_equal(f(q, k, v), good)
        with pytest.raises(Exception, match="operand `k`"):
            _fwd(dict(_inputs(), k=jnp.zeros((B, S, K, H), jnp.float16)), _attrs())

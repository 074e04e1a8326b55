"""The call record and the backend contract (docs/architecture.md): one Call per call, fixed
result records, the registry as the one list of backends, the vmap fold applied once."""

from __future__ import annotations

import typing

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import maxattn
from helpers import assert_close, random_inputs
from maxattn._src import api, backends
from maxattn._src.call import Alignment, Call, Fwd, Grads, Saved, SoftmaxType
from maxattn._src.canonicalize import canonicalize


def test_implementation_hint_lists_the_registry():
    assert set(typing.get_args(api.Implementation)) == set(backends.names())


def test_canonicalize_builds_one_record():
    q, k, v = random_inputs(0, 2, 8, 12, 4, 2, 8, 8, jnp.float32)
    call, cp, unbatched = canonicalize(q, k, v, is_causal=True, causal_alignment="bottom_right",
                                       local_window_size=3, query_seq_lengths=jnp.array([8, 5]),
                                       softmax_type="off_by_one", return_max_logit=True)
    assert cp is None and not unbatched and isinstance(call, Call)
    o = call.options
    assert o.mask.causal and o.mask.alignment is Alignment.BOTTOM_RIGHT and o.mask.window_left == 3
    assert o.softmax is SoftmaxType.OFF_BY_ONE and o.max_logit and not o.lse
    hash(o)  # static, hashable: the key of every cache
    ops = call.operands
    assert ops.bias is None and ops.kv_seq_lengths is None and ops.q_seq_lengths.dtype == jnp.int32
    np.testing.assert_array_equal(ops.sink_logits, np.zeros(4, np.float32))
    # The attributes are exactly the C++ AttentionOptions members.
    assert list(o.ffi_attributes()) == ["scale", "causal", "alignment", "window_left", "window_right", "softcap",
                                        "dropout_rate", "max_segments", "deterministic"]
    # A pytree: options are static metadata, operands the leaves.
    leaves, tree = jax.tree.flatten(call)
    assert len(leaves) == 5 and jax.tree.unflatten(tree, leaves).options == o


@pytest.mark.parametrize("name", ["cpu", "xla"])
@pytest.mark.parametrize("lse, max_logit", [(False, False), (True, False), (False, True), (True, True)])
def test_backends_return_fixed_records(name, lse, max_logit):
    q, k, v = random_inputs(1, 2, 8, 12, 4, 2, 8, 8, jnp.float32)
    call = canonicalize(q, k, v, return_lse=lse, return_max_logit=max_logit).call
    backend = backends.get(name)
    fwd = backend.forward(call)
    assert isinstance(fwd, Fwd) and fwd.out.shape == (2, 8, 4, 8)
    assert (fwd.lse is not None) == lse and (fwd.max_logit is not None) == max_logit
    if max_logit:
        assert fwd.max_logit.shape == (2, 4)
    full = backend.forward(call.replace(call.options.replace(lse=True)))
    g = backend.backward(call, Saved(full.out, full.lse, jnp.ones_like(full.out)))
    assert isinstance(g, Grads) and g.dbias is None and g.dsink is None
    assert g.dq.shape == q.shape and g.dk.shape == k.shape and g.dv.shape == v.shape


def test_backends_agree_through_the_contract():
    q, k, v = random_inputs(2, 2, 8, 12, 4, 2, 8, 8, jnp.float32)
    bias = jnp.asarray(np.random.default_rng(0).standard_normal((1, 4, 8, 12)), jnp.float32)
    call = canonicalize(q, k, v, bias, is_causal=True, softmax_type="off_by_one", return_lse=True,
                        return_max_logit=True).call
    a, b = backends.get("cpu"), backends.get("xla")
    fa, fb = a.forward(call), b.forward(call)
    for x, y, what in zip(fa, fb, Fwd._fields):
        assert_close(x, y, 1e-5, what)
    saved = Saved(fa.out, fa.lse, jnp.ones_like(fa.out), jnp.ones_like(fa.lse))
    ga, gb = a.backward(call, saved), b.backward(call, saved)
    for x, y, what in zip(ga, gb, Grads._fields):
        assert x is not None and x.shape == y.shape, what
        assert_close(x, y, 1e-5, what)


def test_vmap_folds_once_into_the_batch():
    """Under two nested vmaps the compiled program runs the kernel once, on the folded
    [V1*V2*B] batch (not once per level, and not once per instance)."""
    q, k, v = random_inputs(3, 2, 8, 8, 2, 2, 8, 8, jnp.float32)
    qs, ks, vs = (jnp.stack([jnp.stack([x * (i + 1) * (j + 1) for j in range(2)]) for i in range(3)])
                  for x in (q, k, v))
    f = lambda q, k, v: maxattn.dot_product_attention(q, k, v, implementation="cpu", return_max_logit=True)
    g = jax.jit(jax.vmap(jax.vmap(f)))
    hlo = g.lower(qs, ks, vs).compile().as_text()
    calls = [line for line in hlo.splitlines() if "maxattn_attention_fwd_cpu" in line and "custom-call(" in line]
    assert len(calls) == 1, calls
    assert "f32[12,8,2,8]" in calls[0], calls[0]
    out, aux = g(qs, ks, vs)
    assert out.shape == (3, 2, 2, 8, 2, 8) and aux["max_logit"].shape == (3, 2, 2)
    ref = maxattn.reference(qs[2, 1], ks[2, 1], vs[2, 1], return_max_logit=True)[1]["max_logit"]
    np.testing.assert_allclose(aux["max_logit"][2, 1], ref, rtol=1e-5)


@pytest.mark.parametrize("impl", ["cpu", "xla"])
def test_deterministic_backward_is_an_option(impl):
    """deterministic_backward is a static option of the record; cpu and xla are deterministic
    already, so it changes no bit there. It must be a Python bool."""
    q, k, v = random_inputs(5, 2, 40, 56, 4, 2, 16, 16, jnp.float32)
    assert canonicalize(q, k, v, deterministic_backward=True).call.options.deterministic
    assert not canonicalize(q, k, v).call.options.deterministic

    def grads(det):
        loss = lambda q, k, v: jnp.sum(maxattn.dot_product_attention(
            q, k, v, is_causal=True, implementation=impl, deterministic_backward=det) ** 2)
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)

    for a, b in zip(grads(False), grads(True)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    with pytest.raises(TypeError, match="`deterministic_backward`"):
        maxattn.dot_product_attention(q, k, v, deterministic_backward=1)

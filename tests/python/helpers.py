"""Shared helpers of the Python tests: random inputs, the float64 oracle, tolerances."""

from __future__ import annotations

import contextlib
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import maxattn

# docs/contract.md, "Tolerances the tests use".
OUT_TOL = {jnp.float32: 1e-5, jnp.bfloat16: 2e-2, jnp.float16: 2e-2}
MAX_TOL = {jnp.float32: 1e-5, jnp.bfloat16: 1e-3, jnp.float16: 1e-3}


def has_gpu() -> bool:
    """True when JAX has a GPU backend."""
    try:
        return len(jax.devices("gpu")) > 0
    except RuntimeError:
        return False


# Marks of a GPU-only test: selected by `-m gpu`, skipped (not passed) without a GPU.
GPU_MARKS = [pytest.mark.gpu, pytest.mark.skipif(not has_gpu(), reason="needs a CUDA GPU (jax has none)")]


def bias_and_cotangents(rng: np.random.Generator, B: int, T: int, S: int, N: int, Hv: int,
                        bias_shape: str | None, dtype) -> tuple:
    """(bias or None, ct_out [B, T, N, Hv] f32, ct_lse [B, N, T] f32), drawn from `rng` in that order.

    `bias_shape` spells the bias dims from "BNTS" (e.g. "1NTS", "B11S"). The bias is drawn in `dtype`
    (the activation dtype: the cudnn backend consumes the bias in it; DESIGN §3 compares on the same
    rounded inputs)."""
    bias = None
    if bias_shape:
        full = dict(B=B, N=N, T=T, S=S)
        bias = jnp.asarray(rng.standard_normal([full.get(c, 1) for c in bias_shape]), dtype)
    ct_out = jnp.asarray(rng.standard_normal((B, T, N, Hv)), jnp.float32)
    ct_lse = jnp.asarray(rng.standard_normal((B, N, T)), jnp.float32)
    return bias, ct_out, ct_lse


def x64():
    """Context manager enabling float64 (spelled differently across jax versions)."""
    if hasattr(jax, "enable_x64"):
        return jax.enable_x64(True)
    from jax.experimental import enable_x64  # jax < 0.11
    return enable_x64()


def rel_l2(x, ref) -> float:
    x = np.asarray(x, np.float64)
    ref = np.asarray(ref, np.float64)
    assert x.shape == ref.shape, (x.shape, ref.shape)
    finite = np.isfinite(ref)
    np.testing.assert_array_equal(np.isfinite(x), finite, err_msg="non-finite entries differ")
    np.testing.assert_array_equal(x[~finite], ref[~finite], err_msg="infinite entries differ")
    num = np.linalg.norm(x[finite] - ref[finite])
    den = np.linalg.norm(ref[finite])
    return float(num / den) if den > 0 else float(num)


def assert_close(x, ref, tol: float, what: str) -> None:
    err = rel_l2(x, ref)
    assert err <= tol, f"{what}: rel-L2 error {err:.3g} > {tol:.1g}"


def assert_max_logit_close(x, ref, tol: float) -> None:
    x = np.asarray(x, np.float64)
    ref = np.asarray(ref, np.float64)
    assert x.shape == ref.shape and x.dtype == np.float64
    np.testing.assert_array_equal(np.isnan(x), np.isnan(ref), err_msg="NaN pattern of max_logit differs")
    np.testing.assert_array_equal(np.isneginf(x), np.isneginf(ref), err_msg="-inf pattern of max_logit differs")
    ok = np.isfinite(ref)
    rel = np.abs(x[ok] - ref[ok]) / np.maximum(np.abs(ref[ok]), 1e-6)
    assert rel.size == 0 or rel.max() <= tol, f"max_logit rel error {rel.max():.3g} > {tol:.1g}: {x} vs {ref}"


def random_inputs(seed: int, B: int, T: int, S: int, N: int, K: int, H: int, Hv: int, dtype) -> tuple:
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((B, T, N, H)), dtype)
    k = jnp.asarray(rng.standard_normal((B, S, K, H)), dtype)
    v = jnp.asarray(rng.standard_normal((B, S, K, Hv)), dtype)
    return q, k, v


def loss_and_grads(fn, q, k, v, bias, ct_out, ct_lse, **kwargs):
    """out, aux and grads of <out, ct_out> + <finite lse, ct_lse> w.r.t. q, k, v, bias."""

    def f(q, k, v, bias):
        out, aux = fn(q, k, v, bias, return_max_logit=True, return_lse=True, **kwargs)
        lse = aux["lse"]
        lse_term = jnp.sum(jnp.where(jnp.isfinite(lse), lse, 0.0) * ct_lse.astype(lse.dtype))
        loss = jnp.sum(out.astype(ct_out.dtype) * ct_out) + lse_term
        return loss, (out, aux)

    argnums = (0, 1, 2, 3) if bias is not None else (0, 1, 2)
    grads, (out, aux) = jax.grad(f, argnums=argnums, has_aux=True)(q, k, v, bias)
    return out, aux, grads


def reference64(q, k, v, bias, ct_out, ct_lse, **kwargs: Any):
    """The float64 oracle on the same (rounded) inputs: out, aux, grads as numpy."""
    with x64():
        cast = lambda x: None if x is None else jnp.asarray(np.asarray(x, np.float64))
        kw = dict(kwargs)
        kw.pop("implementation", None)
        out, aux, grads = loss_and_grads(maxattn.reference, cast(q), cast(k), cast(v), cast(bias),
                                         cast(ct_out), cast(ct_lse), **kw)
        return jax.tree.map(np.asarray, (out, aux, grads))


def use_xla_backend_in_key_blocks(monkeypatch: pytest.MonkeyPatch, key_block: int) -> None:
    """implementation="xla" through the backend stack (custom_vjp with backends/xla.py's backward,
    as under context parallelism and behind soft-capped sm90 forwards whose backward ours
    refuses) instead of plain JAX autodiff of the reference, its backward walking the keys in
    blocks of `key_block`."""
    from maxattn._src import api, partition, stack
    from maxattn._src.backends import xla
    monkeypatch.setattr(api, "_choose_backend", lambda implementation, call: "xla")
    monkeypatch.setattr(xla, "KEY_BLOCK", key_block)
    # The stack and its custom-partitioned functions are cached, and with them the traces of the
    # backward: fresh caches, so that this block size is traced (and no later test reuses them).
    monkeypatch.setattr(stack, "fused", functools.cache(stack.fused.__wrapped__))
    monkeypatch.setattr(partition, "_partitioned_fn", functools.cache(partition._partitioned_fn.__wrapped__))


@contextlib.contextmanager
def no_warnings():
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield

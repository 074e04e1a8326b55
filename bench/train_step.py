"""A jitted training step of a small transformer layer stack, per backend, with and without max_logit.

The stack: `--layers` pre-LN blocks of d_model = N*H (attention with GQA K heads through
maxattn.dot_product_attention, causal; a 4x GELU MLP), bf16 activations and fp32 parameters, a
mean-square loss on the output, SGD. Variants, per backend:

  step          plain step (no max_logit)
  step+clip     the attention also returns max_logit [N] per layer, and QK-Clip
                (maxattn.qk_clip.clip_factors, threshold 100) rescales W_q and W_k after the update
                -- what a MuonClip user runs
  fa3 step      the same plain step with FlashAttention-3 (flash-attn3-jax flash_mha) as attention,
                when the wheel is importable

Timing as in bench/gpu.py: a sample is `--calls` back-to-back steps then one block_until_ready;
variants interleaved, the order alternating; medians over `--reps`, plus the paired ratio
(median of per-repetition ratios) of step+clip against step.

With --trace each sample is instead the device time of the step's kernels, from JAX's own profiler
(bench/trace_time.py: CUPTI, at full speed, in this process): the same interleaved samples and
paired ratios as wall clock, without launch gaps and host noise.

With --ncu each variant instead runs in its own process under Nsight Compute (bench/ncu_time.py) and
the table reports the device time of all kernels of a step (launch gaps and memsets excluded): stable
to a fraction of a percent, so it can show a max_logit + QK-Clip cost near 1% that wall clock cannot.
ncu costs tens of milliseconds per profiled kernel, so keep the profiled work small
(`--ncu --layers 1 --calls 1`: a minute or less per variant); each child reports its time on stderr.

Usage (on the GPU machine): python bench/train_step.py [--impls sm90,cudnn] [--fa3] [--trace | --ncu]
[--json out.json]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import maxattn
import ncu_time
import trace_time
from maxattn.qk_clip import clip_factors


def init_params(key, layers, d, n, kv, h):
    def dense(k, fan_in, shape):
        return jax.random.normal(k, shape, jnp.float32) * fan_in ** -0.5

    params = []
    for lk in jax.random.split(key, layers):
        ks = jax.random.split(lk, 6)
        params.append(dict(wq=dense(ks[0], d, (d, n, h)), wk=dense(ks[1], d, (d, kv, h)),
                           wv=dense(ks[2], d, (d, kv, h)), wo=dense(ks[3], n * h, (n, h, d)),
                           w1=dense(ks[4], d, (d, 4 * d)), w2=dense(ks[5], 4 * d, (4 * d, d))))
    return params


def _layer_norm(x):
    x32 = x.astype(jnp.float32)
    mu = x32.mean(-1, keepdims=True)
    var = ((x32 - mu) ** 2).mean(-1, keepdims=True)
    return ((x32 - mu) * jax.lax.rsqrt(var + 1e-5)).astype(x.dtype)


def make_step(attention, with_clip, lr=1e-3, threshold=100.0):
    """attention(q, k, v) -> (out, max_logit or None)."""

    def forward(params, x):
        max_logits = []
        for p in params:
            y = _layer_norm(x)
            q = jnp.einsum("btd,dnh->btnh", y, p["wq"].astype(y.dtype))
            k = jnp.einsum("btd,dnh->btnh", y, p["wk"].astype(y.dtype))
            v = jnp.einsum("btd,dnh->btnh", y, p["wv"].astype(y.dtype))
            o, mx = attention(q, k, v)
            max_logits.append(mx)
            x = x + jnp.einsum("btnh,nhd->btd", o, p["wo"].astype(o.dtype))
            y = _layer_norm(x)
            x = x + jnp.einsum("btf,fd->btd", jax.nn.gelu(y @ p["w1"].astype(y.dtype)), p["w2"].astype(y.dtype))
        return x, max_logits

    def loss_fn(params, x):
        out, max_logits = forward(params, x)
        return jnp.mean(out.astype(jnp.float32) ** 2), max_logits

    @jax.jit
    def step(params, x):
        (loss, max_logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, x)
        params = jax.tree.map(lambda p, g: p - lr * g, params, grads)
        if with_clip:
            clipped = []
            for p, mx in zip(params, max_logits):
                q_f, k_f = clip_factors(mx, threshold, num_kv_heads=p["wk"].shape[1])
                clipped.append(dict(p, wq=p["wq"] * q_f[None, :, None], wk=p["wk"] * k_f[None, :, None]))
            params = clipped
        return params, loss

    return step


def attention_for(impl, with_max):
    if impl == "fa3":
        from flash_attn3_jax import flash_mha

        def fa3(q, k, v):
            return flash_mha(q, k, v, softmax_scale=q.shape[-1] ** -0.5, is_causal=True), None
        return fa3

    def attn(q, k, v):
        if with_max:
            out, aux = maxattn.dot_product_attention(q, k, v, is_causal=True, implementation=impl,
                                                     return_max_logit=True)
            return out, aux["max_logit"]
        return maxattn.dot_product_attention(q, k, v, is_causal=True, implementation=impl), None
    return attn


def _fa3_available():
    try:
        import flash_attn3_jax  # noqa: F401
        return True
    except Exception:
        return False


def _variants(opts) -> dict:
    variants = {}
    for impl in opts.impls.split(","):
        variants[f"{impl} step"] = make_step(attention_for(impl, False), False)
        variants[f"{impl} step+clip"] = make_step(attention_for(impl, True), True)
    if opts.fa3 and _fa3_available():
        variants["fa3 step"] = make_step(attention_for("fa3", False), False)
    return variants


def _device_times(opts, argv, names) -> tuple[dict, dict]:
    """Device seconds per step of each variant, each in its own process under ncu; and the errors."""
    seconds, errors = {}, {}
    child = [a for a in argv if a != "--ncu"]
    for name in names:
        t0 = time.perf_counter()
        kernels = ncu_time.kernel_times([sys.executable, __file__, *child, "--child", name], timeout=opts.ncu_timeout,
                                        live_stderr=True, xla_flags=opts.ncu_xla_flags)
        if isinstance(kernels, str):
            lines = kernels.strip().splitlines() or ["no kernels profiled"]
            errors[name] = next((ln for ln in reversed(lines) if re.match(r"\w*(Error|Exception)\b", ln)), lines[-1])
            print(f"# {name}: {errors[name]}", file=sys.stderr, flush=True)
        else:
            seconds[name] = sum(ns for _, ns in kernels) / opts.calls / 1e9  # as the wall-clock samples
            # ncu costs tens of ms per profiled kernel: say how long a child took, to size --calls/--layers
            print(f"# {name}: {seconds[name] * 1e3:.3f} ms/step, {len(kernels) // opts.calls} kernels/step, "
                  f"child {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    return seconds, errors


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--impls", default="sm90,cudnn")
    p.add_argument("--fa3", action="store_true")
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--shape", default="4,2048,16,16,128", help="B,T,N,K,H")
    p.add_argument("--calls", type=int, default=5)
    p.add_argument("--reps", type=int, default=7)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--trace", action="store_true", help="device time per step from the JAX profiler (CUPTI)")
    p.add_argument("--ncu", action="store_true", help="device time per step from Nsight Compute")
    p.add_argument("--ncu-timeout", type=float, default=300, help="seconds per --ncu child")
    # On the H200 (2026-12-05) every --ncu child died with a segmentation fault before its first step,
    # while gpu_kernels.py's children (attention alone, no GEMM to autotune) ran under the same ncu.
    # XLA's GEMM autotuner, which runs candidate kernels while compiling, is what only these children
    # do: it is off by default here (the same GEMMs in every variant, so the comparison holds).
    p.add_argument("--ncu-xla-flags", default="--xla_gpu_autotune_level=0",
                   help="extra XLA_FLAGS for the --ncu children ('' for none)")
    p.add_argument("--child", help=argparse.SUPPRESS)  # --ncu's child: run this variant's profiled steps
    p.add_argument("--json")
    opts = p.parse_args(argv)
    if opts.ncu and opts.trace:
        p.error("--trace and --ncu are two ways to time the same thing: pick one")
    B, T, N, K, H = (int(x) for x in opts.shape.split(","))
    d = N * H
    variants = _variants(opts)
    if not opts.ncu or opts.child:  # with --ncu only the children touch the GPU
        params = init_params(jax.random.key(0), opts.layers, d, N, K, H)
        x = jax.random.normal(jax.random.key(1), (B, T, d), jnp.bfloat16)
    if opts.child:  # progress on stderr (the parent passes it through), so a slow child shows where it is
        t0 = time.perf_counter()
        fn = variants[opts.child]
        for _ in range(opts.warmup + 1):
            jax.block_until_ready(fn(params, x))
        print(f"#   {opts.child}: compiled and warmed up in {time.perf_counter() - t0:.0f} s", file=sys.stderr,
              flush=True)
        with ncu_time.profiled():
            out = None
            for _ in range(opts.calls):
                out = fn(params, x)
            jax.block_until_ready(out)
        print(f"#   {opts.child}: profiled steps done at {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
        return
    errors = {}
    if opts.ncu:  # the children compile and run the variants (a refusal is their error)
        med, errors = _device_times(opts, argv, list(variants))
        samples = {n: [m] for n, m in med.items()}
        how = f"device time of all kernels of a step (ncu), {opts.calls} steps"
    else:
        for name, fn in list(variants.items()):
            try:
                jax.block_until_ready(fn(params, x))
            except Exception as e:  # a refusal (no Hopper GPU, ...)
                errors[name] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
                del variants[name]
        timed, no_kernels = trace_time.interleaved({n: lambda fn=fn: fn(params, x) for n, fn in variants.items()},
                                                   opts.calls, opts.reps, warmup=opts.warmup, trace=opts.trace)
        if no_kernels:
            sys.exit(f"--trace: {no_kernels}")
        samples = {n: [s.seconds for s in runs] for n, runs in timed.items()}
        med = {n: statistics.median(s) for n, s in samples.items()}
        how = (f"median of {opts.reps} samples of {opts.calls} steps"
               + (", device time of the step's kernels (JAX profiler)" if opts.trace else ""))
    print(f"# {opts.layers} layers, B,T,N,K,H = {B},{T},{N},{K},{H}, causal, bf16; {jax.devices()[0].device_kind}; "
          f"{how}")
    print("| variant | ms/step | spread % | vs plain step of the backend (paired) |")
    print("|---|---|---|---|")
    result = {"shape": [B, T, N, K, H], "layers": opts.layers,
              "timing": "ncu" if opts.ncu else "jax profiler" if opts.trace else "wall clock",
              "ms": {}, "errors": errors}
    for name, s in samples.items():
        spread = (max(s) - min(s)) / med[name] * 100
        base = name.replace("step+clip", "step")
        paired = ""
        if base != name and base in samples:
            ratios = [a / b for a, b in zip(s, samples[base])]
            paired = f"{(statistics.median(ratios) - 1) * 100:+.2f}%"
            result.setdefault("clip_overhead_pct", {})[name] = (statistics.median(ratios) - 1) * 100
        print(f"| {name} | {med[name] * 1e3:.3f} | {spread:.1f} | {paired} |")
        result["ms"][name] = med[name] * 1e3
    for name, why in errors.items():
        print(f"| {name} | refused: {why} | | |")
    if "fa3 step" in med:
        for impl in opts.impls.split(","):
            if f"{impl} step" in med:
                print(f"# {impl} step vs fa3 step: FA3 time / ours = {med['fa3 step'] / med[f'{impl} step']:.3f}")
    if opts.json:
        with open(opts.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

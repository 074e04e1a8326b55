"""GPU benchmark of the cudnn backend (bf16) against JAX's own cuDNN attention.

For each (B, T, N, K, H) row it times, in the same process and the same way
(`--calls` jitted calls back to back, one sync at the end, median of
`--reps` interleaved repetitions):
  fwd          maxattn cudnn forward, output only
  fwd+max      maxattn cudnn forward with return_max_logit=True
  fwd+bwd      grad of <out, ct> w.r.t. q, k, v (maxattn)
  jax fwd      jax.nn.dot_product_attention(implementation="cudnn")
  jax fwd+bwd  the same, differentiated
  jax+max      jax cudnn forward plus a separate max-logit pass (QK^T in f32)
and prints a markdown table with TFLOP/s and the ratios the issue targets.

Usage: python bench/gpu.py [--calls 50] [--reps 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np

import maxattn

ROWS = [  # (B, T, N, K, H, causal)
    (4, 2048, 32, 32, 128, True),
    (4, 2048, 32, 32, 128, False),
    (2, 8192, 16, 16, 128, True),
    (4, 4096, 32, 8, 128, True),
    (8, 2048, 16, 16, 64, True),
]


def _timed(fn, args, calls):
    out = fn(*args)
    jax.block_until_ready(out)
    start = time.perf_counter()
    for _ in range(calls):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - start) / calls


def _separate_max(q, k, causal, scale):
    """What users do today: recompute the logits to get the per-head max."""
    N, K = q.shape[2], k.shape[2]
    k = jnp.repeat(k, N // K, axis=2)
    s = jnp.einsum("btnh,bsnh->bnts", q, k, preferred_element_type=jnp.float32) * scale
    if causal:
        T, S = q.shape[1], k.shape[1]
        s = jnp.where(jnp.arange(S)[None, :] <= jnp.arange(T)[:, None], s, -jnp.inf)
    return jnp.max(s, axis=(0, 2, 3))


def bench_row(B, T, N, K, H, causal, calls, reps):
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((B, T, K, H)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((B, T, K, H)), jnp.bfloat16)
    ct = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.bfloat16)
    scale = 1.0 / np.sqrt(H)

    def mx(q, k, v, **kw):
        return maxattn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn", **kw)

    def jx(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn")

    def grad_of(f):
        return jax.grad(lambda q, k, v: jnp.sum((f(q, k, v) * ct).astype(jnp.float32)), argnums=(0, 1, 2))

    fns = {
        "fwd": jax.jit(lambda q, k, v: mx(q, k, v)),
        "fwd+max": jax.jit(lambda q, k, v: mx(q, k, v, return_max_logit=True)),
        "fwd+bwd": jax.jit(grad_of(lambda q, k, v: mx(q, k, v))),
        "jax fwd": jax.jit(jx),
        "jax fwd+bwd": jax.jit(grad_of(jx)),
        "jax+max": jax.jit(lambda q, k, v: (jx(q, k, v), _separate_max(q, k, causal, scale))),
    }
    times = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            times[name].append(_timed(fn, (q, k, v), calls))
    med = {name: statistics.median(t) for name, t in times.items()}
    flops = 4.0 * B * N * T * T * H * (0.5 if causal else 1.0)
    return dict(
        shape=dict(B=B, T=T, N=N, K=K, H=H, causal=causal),
        ms={name: t * 1e3 for name, t in med.items()},
        tflops_fwd=flops / med["fwd"] / 1e12,
        tflops_fwd_bwd=3.5 * flops / med["fwd+bwd"] / 1e12,
        max_overhead_pct=100.0 * (med["fwd+max"] - med["fwd"]) / med["fwd"],
        fwd_vs_jax=med["jax fwd"] / med["fwd"],
        fwd_bwd_vs_jax=med["jax fwd+bwd"] / med["fwd+bwd"],
        max_vs_jax_plus_pass=med["jax+max"] / med["fwd+max"],
        spread_pct={name: 100.0 * (max(t) - min(t)) / statistics.median(t) for name, t in times.items()},
    )


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=50)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from maxattn._src import cudnn as backend

    dev = jax.devices()[0]
    info = dict(device=dev.device_kind, jax=jax.__version__, cudnn=backend.cudnn_version())
    print(f"# maxattn GPU benchmark: {info}, bf16, {args.calls} calls x {args.reps} reps, median", flush=True)
    results = []
    header = ("| B | T | N | K | H | causal | fwd ms | fwd+max ms | max ovh % | fwd TFLOP/s | fwd+bwd ms "
              "| fwd+bwd TFLOP/s | jax fwd ms | jax fwd+bwd ms | jax+max ms | fwd vs jax | fwd+bwd vs jax "
              "| fwd+max vs jax+max |")
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for row in ROWS:
        r = bench_row(*row, calls=args.calls, reps=args.reps)
        results.append(r)
        s, ms = r["shape"], r["ms"]
        print(f"| {s['B']} | {s['T']} | {s['N']} | {s['K']} | {s['H']} | {s['causal']} | {ms['fwd']:.3f} "
              f"| {ms['fwd+max']:.3f} | {r['max_overhead_pct']:+.1f} | {r['tflops_fwd']:.0f} | {ms['fwd+bwd']:.3f} "
              f"| {r['tflops_fwd_bwd']:.0f} | {ms['jax fwd']:.3f} | {ms['jax fwd+bwd']:.3f} | {ms['jax+max']:.3f} "
              f"| {r['fwd_vs_jax']:.3f}x | {r['fwd_bwd_vs_jax']:.3f}x | {r['max_vs_jax_plus_pass']:.2f}x |",
              flush=True)
    print("\nrepetition spread (max-min)/median %:", json.dumps([r["spread_pct"] for r in results]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(info=info, calls=args.calls, reps=args.reps, results=results), f, indent=1)


if __name__ == "__main__":
    main()

"""Device time per call, kernel by kernel, from Nsight Compute: the cost of max_logit, ours vs FA3, and
(with --bwd) the forward+backward of a training step on ours, on our cuDNN path and on FA3.

Wall-clock timing of back-to-back calls (bench/gpu.py) spreads by 10-50% on
the shared H200, more than the 2% overhead target. This script measures what
the GPU itself spends: each variant runs in its own process under

    ncu --profile-from-start off --clock-control none --metrics gpu__time_duration.sum

with the profiler started (cudaProfilerStart via CuPy) only around `--calls`
warm calls, so compilation and warm-up are not counted. ncu serialises the
kernels, so the sums exclude launch gaps; they are the device time of every
kernel a call launches (the attention kernel, our helpers and XLA's), split by
origin. The "fa3" variant runs FlashAttention-3's forward (flash-attn3-jax
flash_mha, when installed) on the same inputs, so its kernel time sits next to
ours in one run; the gap between these sums and bench/gpu.py's wall clock is
launch and dispatch cost. With --bwd the variants are instead the gradient of
<out, ct> with respect to q, k and v (forward with lse, then backward):
"fwd+bwd" on --impl, "cudnn fwd+bwd" on implementation="cudnn", with
--deterministic also "det fwd+bwd" (--impl with deterministic_backward=True)
and, with --fa3, "fa3 fwd+bwd" (flash_mha differentiated). `--variants` picks
a subset by name; it can also name the soft-cap variants, which no default
includes: "fwd+cap50" and "cap50 fwd+bwd" (--impl with logits_soft_cap=50).

With --trace the variants instead run in this one process, timed by JAX's own profiler (CUPTI's
activity records, bench/trace_time.py): no ncu child per variant (whose start-up under ncu took
~2 minutes of a device call per forward+backward variant), the variants' samples interleaved
(--reps of --calls calls each, the order alternating), medians reported. The kernels run at full
speed rather than serialised, so the sums are the same device time without ncu's replay.

Usage (on the GPU machine):
    python bench/gpu_kernels.py [--impl cudnn|sm90] [--calls 5] [--shapes 0,1] [--fa3] [--bwd [--deterministic]]
                                [--variants fwd,fwd+cap50,...] [--trace [--reps 5]] [--json out.json]
    python bench/gpu_kernels.py --run VARIANT SHAPE CALLS IMPL   # just the calls, e.g. under ncu_hotspots.py
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import ncu_time

SOFT_CAP = 50.0  # the "cap50" variants' logits_soft_cap
VARIANTS = {  # name: (return_lse, return_max_logit, logits_soft_cap)
    "fwd": (False, False, None),
    "fwd+max": (False, True, None),
    "fwd+lse": (True, False, None),
    "fwd+lse+max": (True, True, None),
    "fwd+cap50": (False, False, SOFT_CAP),
}
BWD_VARIANTS = ("fwd+bwd", "cudnn fwd+bwd", "det fwd+bwd", "cap50 fwd+bwd", "fa3 fwd+bwd")
# The first three keep their indices (tools/gpu_check.sh's KERNEL_SHAPES); the rest are bench/gpu.py's rows.
SHAPES = [(4, 2048, 32, 32, 128, True), (8, 2048, 16, 16, 64, True), (2, 8192, 16, 16, 128, True),
          (4, 2048, 32, 32, 128, False), (4, 4096, 32, 8, 128, True),
          (4, 2048, 16, 16, 256, True)]  # head dim 256 (Gemma's): sm90's forward against cuDNN's


def _build(variant: str, shape_index: int, impl: str):
    """The jitted call of one variant at one shape, and its inputs."""
    import jax
    import jax.numpy as jnp

    import maxattn

    B, T, N, K, H, causal = SHAPES[shape_index]
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (B, T, N, H), jnp.bfloat16)
    k = jax.random.normal(keys[1], (B, T, K, H), jnp.bfloat16)
    v = jax.random.normal(keys[2], (B, T, K, H), jnp.bfloat16)

    if variant.endswith("fwd+bwd"):
        ct = jax.random.normal(jax.random.key(1), q.shape, jnp.float32)
        if variant.startswith("fa3"):
            from flash_attn3_jax import flash_mha
            attn = lambda q, k, v: flash_mha(q, k, v, softmax_scale=H ** -0.5, is_causal=causal)
        else:
            backend = "cudnn" if variant.startswith("cudnn") else impl
            det = variant.startswith("det")
            cap = SOFT_CAP if variant.startswith("cap50") else None
            attn = lambda q, k, v: maxattn.dot_product_attention(q, k, v, is_causal=causal, implementation=backend,
                                                                 deterministic_backward=det, logits_soft_cap=cap)
        grad = jax.grad(lambda q, k, v: jnp.sum(attn(q, k, v).astype(jnp.float32) * ct), argnums=(0, 1, 2))
        fn = jax.jit(grad)
    elif variant == "fa3":
        from flash_attn3_jax import flash_mha

        @jax.jit
        def fn(q, k, v):
            return flash_mha(q, k, v, softmax_scale=H ** -0.5, is_causal=causal)
    else:
        want_lse, want_max, cap = VARIANTS[variant]

        @jax.jit
        def fn(q, k, v):
            return maxattn.dot_product_attention(q, k, v, is_causal=causal, implementation=impl,
                                                 return_lse=want_lse, return_max_logit=want_max, logits_soft_cap=cap)

    return fn, (q, k, v)


def _child(variant: str, shape_index: int, calls: int, impl: str) -> None:
    import jax

    fn, inputs = _build(variant, shape_index, impl)
    for _ in range(3):
        jax.block_until_ready(fn(*inputs))
    with ncu_time.profiled():
        for _ in range(calls):
            jax.block_until_ready(fn(*inputs))


def _origin(name: str) -> str:
    """"attention" (the attention kernel: cuDNN's, our sm90 FwdKernel, FA3's), "maxattn" (our helper
    kernels) or "xla"."""
    if "FwdKernel" in name or "BwdKernel" in name:
        return "attention"
    # ncu names a kernel with or without its namespaces, so our helpers are matched by name too.
    helpers = ("Finalize", "ScaleRows", "SinkRow", "BwdPrepass", "BwdPostpass", "RowSum")
    if "maxattn" in name or any(h in name for h in helpers):
        return "maxattn"
    if name.startswith(("cudnn", "sm90", "sm80", "cutlass")) or "cudnn" in name or "flash" in name.lower():
        return "attention"
    return "xla"


def _summary(kernels: list[tuple[str, float]], calls: int) -> dict:
    """A variant's row from the (name, ns) of its kernels over `calls` calls."""
    by_origin: dict[str, float] = {}
    names: dict[str, float] = {}
    for name, ns in kernels:
        by_origin[_origin(name)] = by_origin.get(_origin(name), 0.0) + ns / calls
        names[name[:90]] = names.get(name[:90], 0.0) + ns / calls
    return {"us_per_call": sum(ns for _, ns in kernels) / calls / 1e3,
            "by_origin_us": {k: v / 1e3 for k, v in by_origin.items()},
            "kernels_us": {k: v / 1e3 for k, v in names.items()},
            "kernels_per_call": len(kernels) / calls}


def _profile(variant: str, shape_index: int, calls: int, impl: str) -> dict:
    kernels = ncu_time.kernel_times([sys.executable, __file__, "--child", variant, str(shape_index), str(calls), impl],
                                    timeout=300)
    if isinstance(kernels, str):
        return {"error": kernels}
    return _summary(kernels, calls)


def _trace_row(variants: list[str], shape_index: int, calls: int, impl: str, reps: int) -> dict:
    """--trace: every variant in this process, --reps interleaved samples of `calls` calls each
    under the JAX profiler (trace_time.interleaved). A variant's row is its median sample (device
    time per call) with the kernel breakdown of all samples; a variant that fails to run gets its
    error."""
    import jax

    import trace_time

    built, row = {}, {}
    for v in variants:
        try:
            fn, inputs = _build(v, shape_index, impl)
            for _ in range(3):
                jax.block_until_ready(fn(*inputs))
            built[v] = lambda fn=fn, inputs=inputs: fn(*inputs)
        except Exception as e:  # a refusal (no Hopper GPU, FA3 not installed, ...)
            row[v] = {"error": f"{type(e).__name__}: {e}"}
    samples, errors = trace_time.interleaved(built, calls, reps)
    row.update({v: {"error": why} for v, why in errors.items()})
    for v, runs in samples.items():
        summary = _summary([kn for run in runs for kn in run.kernels], calls * len(runs))
        per_sample = [run.seconds * 1e6 for run in runs]
        summary["us_per_call"] = statistics.median(per_sample)
        summary["spread_pct"] = (max(per_sample) - min(per_sample)) / summary["us_per_call"] * 100
        row[v] = summary
    return {v: row[v] for v in variants}


def _run_calls(variant: str, shape_index: int, calls: int, impl: str) -> None:
    """--run: the variant's calls with no profiler range, for a profiler that picks kernels by name and
    launch count (bench/ncu_hotspots.py -- python bench/gpu_kernels.py --run fa3 0 5 sm90)."""
    import jax

    fn, inputs = _build(variant, shape_index, impl)
    for _ in range(3 + calls):
        jax.block_until_ready(fn(*inputs))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] in ("--child", "--run"):
        (_child if sys.argv[1] == "--child" else _run_calls)(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=5)
    parser.add_argument("--shapes", default="0,1", help="indices into SHAPES")
    parser.add_argument("--impl", default="cudnn", help="maxattn implementation (cudnn or sm90)")
    parser.add_argument("--fa3", action="store_true", help="also profile FA3's forward (flash-attn3-jax)")
    parser.add_argument("--bwd", action="store_true",
                        help="forward+backward variants: --impl, cudnn and (with --fa3) FA3")
    parser.add_argument("--deterministic", action="store_true",
                        help="with --bwd: also --impl with deterministic_backward=True")
    parser.add_argument("--variants", help="comma-separated subset of the variants to profile (default: all of the "
                        "mode's), e.g. fwd,fwd+max,fa3 -- each variant is one ncu process (without --trace)")
    parser.add_argument("--trace", action="store_true",
                        help="time the variants in this process with the JAX profiler instead of one ncu child each")
    parser.add_argument("--reps", type=int, default=5, help="with --trace: interleaved samples per variant")
    parser.add_argument("--json")
    args = parser.parse_args()
    if args.trace and args.reps < 1:
        parser.error("--reps: at least one sample per variant")
    results = {}
    if args.bwd:
        variants = (["fwd+bwd", "cudnn fwd+bwd"] + (["det fwd+bwd"] if args.deterministic else []) +
                    (["fa3 fwd+bwd"] if args.fa3 else []))
        known = list(BWD_VARIANTS)
    else:
        variants = [v for v, (_, _, cap) in VARIANTS.items() if cap is None] + (["fa3"] if args.fa3 else [])
        known = list(VARIANTS) + ["fa3"]
    if args.variants:
        wanted = args.variants.split(",")
        unknown = sorted(set(wanted) - set(known))
        if unknown:
            parser.error(f"--variants: {unknown} not among this mode's variants {known}")
        variants = [v for v in known if v in wanted]
    how = (f"JAX profiler, median of {args.reps} interleaved samples of {args.calls} calls" if args.trace else
           f"ncu --clock-control none, {args.calls} calls")
    print(f"# impl {args.impl}; device time per call ({how})")
    cols = ("vs fwd+bwd", "vs cudnn fwd+bwd") if args.bwd else ("vs fwd", "vs fwd+lse")
    print("| B | T | N | K | H | causal | variant | GPU µs/call | attention µs | maxattn µs | XLA µs | kernels/call "
          f"| {cols[0]} | {cols[1]} |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for si in (int(s) for s in args.shapes.split(",")):
        B, T, N, K, H, causal = SHAPES[si]
        if args.trace:
            row = _trace_row(variants, si, args.calls, args.impl, args.reps)
        else:
            row = {v: _profile(v, si, args.calls, args.impl) for v in variants}
        results[str(SHAPES[si])] = dict(row, impl=args.impl)
        for v, r in row.items():
            if "error" in r:
                print(f"| {B} | {T} | {N} | {K} | {H} | {causal} | {v} | error: {r['error'][-300:]!r} |")
                continue
            o = r["by_origin_us"]

            def rel(base):
                b = row.get(base, {}).get("us_per_call")
                return f"{(r['us_per_call'] / b - 1) * 100:+.2f}%" if b else "—"

            base = ("fwd+bwd", "cudnn fwd+bwd") if args.bwd else ("fwd", "fwd+lse")

            print(f"| {B} | {T} | {N} | {K} | {H} | {causal} | {v} | {r['us_per_call']:.1f} | "
                  f"{o.get('attention', 0):.1f} | "
                  f"{o.get('maxattn', 0):.1f} | {o.get('xla', 0):.1f} | {r['kernels_per_call']:.0f} | {rel(base[0])} | "
                  f"{rel(base[1])} |")
        ours, fa3 = ("fwd+bwd", "fa3 fwd+bwd") if args.bwd else ("fwd", "fa3")
        if row.get(ours, {}).get("us_per_call") and row.get(fa3, {}).get("us_per_call"):
            print(f"# FA3 time / ours ({fa3} / {ours}): {row[fa3]['us_per_call'] / row[ours]['us_per_call']:.3f}")
        for v, r in row.items():
            for name, us in r.get("kernels_us", {}).items():
                print(f"#   {v:12s} {us:9.2f} µs  {name}")
        sys.stdout.flush()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()

"""GPU benchmark of the cudnn backend (bf16) against JAX's own cuDNN attention.

For each (B, T, N, K, H, causal) row it times, in the same process and the same way:
  fwd          maxattn cudnn forward, output only
  fwd+max      forward with return_max_logit=True          (inference max_logit overhead)
  fwd+lse      forward with return_lse=True                (the training forward)
  fwd+lse+max  forward with return_lse and return_max_logit (training max_logit overhead)
  fwd+bwd      grad of <out, ct> w.r.t. q, k, v (maxattn)
  jax fwd      jax.nn.dot_product_attention(implementation="cudnn")
  jax fwd+bwd  the same, differentiated
  jax+max      jax cudnn forward plus a separate max-logit pass (QK^T in f32)
  fa3 fwd      FlashAttention-3 (the flash-attn3-jax wheel's flash_mha), when it is importable
  fa3 fwd+bwd  the same, differentiated
Then a features table at (4, 2048, 32, 32, 128) bf16 causal: forward and forward+backward of the
baseline, dropout 0.1, learnable attention sinks (with and without max_logit), packed sequences
(4 equal segments per row) and a logit soft cap of 50 (with and without max_logit), with the cost
ratio to the baseline; a feature the backend refuses shows the reason instead of a time.

Timing: one sample = `--settle-s` of untimed calls of the variant (the GPU's clock settles to
its load: on the power-capped H200 a variant timed right after a lighter one otherwise runs at
boost clock), then `--calls` jitted calls back to back and one block_until_ready at the end
(time / calls). Every repetition runs every variant once; variants are interleaved (the group
order rotates each repetition and the pairs being compared sit next to each other, alternating
which goes first), so drifts hit all of them alike. `--warmup` repetitions are run and dropped.
Reported: median over `--reps`; the max_logit overhead also as min-based and paired (median of
the per-repetition ratios); the spread (max-min)/median.

Usage: python bench/gpu.py [--calls 50] [--reps 7] [--settle-s 0.2] [--rows 0,2|all|none] [--skip-features]
                           [--json out.json] [--budget-s 320]
       python bench/gpu.py --smoke        # tiny shapes, implementation="cpu", peer "xla" (no GPU)
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

import maxattn
import trace_time

ROWS = [  # (B, T, N, K, H, causal)
    (4, 2048, 32, 32, 128, True),
    (4, 2048, 32, 32, 128, False),
    (2, 8192, 16, 16, 128, True),
    (4, 4096, 32, 8, 128, True),
    (8, 2048, 16, 16, 64, True),
]
FEATURE_SHAPE = (4, 2048, 32, 32, 128)  # causal
SMOKE_ROWS = [(1, 256, 4, 2, 64, True), (2, 128, 4, 4, 32, False)]
SMOKE_FEATURE_SHAPE = (1, 256, 4, 4, 64)
TARGET_OVERHEAD_PCT = 2.0

# Variant groups of a row, in interleaving order; pairs are compared with each other.
ROW_GROUPS = [["fwd", "fwd+max"], ["fwd+lse", "fwd+lse+max"], ["fwd+bwd"],
              ["jax fwd"], ["jax fwd+bwd"], ["jax+max"], ["fa3 fwd"], ["fa3 fwd+bwd"]]
OVERHEADS = {"inference": ("fwd", "fwd+max"), "training": ("fwd+lse", "fwd+lse+max")}

_T0 = time.perf_counter()


def _elapsed() -> float:
    return time.perf_counter() - _T0


def _reason(e: BaseException) -> str:
    msg = str(e).strip().splitlines()
    return f"{type(e).__name__}: {msg[0] if msg else ''}"


# ---------------------------------------------------------------------------------------------
# timing


def _run(variants, groups, calls, reps, warmup, settle_s=0.0):
    """variants: name -> (jitted fn, args). Compiles (first call) each, then times the interleaved
    repetitions by the wall clock (trace_time.interleaved: the groups rotate, each group's order
    reverses every other repetition). Settle: each sample first runs its variant untimed for
    settle_s. On the H200 both our kernels and FA3's run at the 700 W power cap, where the SM clock
    follows the load within ~0.1 s: without this, a variant timed right after a lighter one runs its
    first calls at boost clock (12% faster in a 2026-12-06 probe), and since the rotation keeps the
    cyclic order of the groups, the same variant would get that head start in every repetition.
    Returns (samples name -> [s], compile_s name -> s, errors name -> reason)."""
    compile_s, errors = {}, {}
    for name, (fn, args) in variants.items():
        t = time.perf_counter()
        try:
            jax.block_until_ready(fn(*args))
        except Exception as e:  # a backend refusal (ValueError at trace time) or a runtime failure
            errors[name] = _reason(e)
            continue
        compile_s[name] = time.perf_counter() - t
    calls_of = {n: (lambda fn=fn, args=args: fn(*args)) for n, (fn, args) in variants.items() if n not in errors}
    timed, _ = trace_time.interleaved(calls_of, calls, reps, warmup=warmup, trace=False, groups=groups,
                                      settle_s=settle_s)
    return {n: [s.seconds for s in runs] for n, runs in timed.items()}, compile_s, errors


def _stats(samples):
    out = {}
    for name, s in samples.items():
        med = statistics.median(s)
        out[name] = dict(median_ms=med * 1e3, min_ms=min(s) * 1e3, max_ms=max(s) * 1e3,
                         spread_pct=100.0 * (max(s) - min(s)) / med, samples_ms=[x * 1e3 for x in s])
    return out


def _overhead(samples, base, var):
    if base not in samples or var not in samples:
        return None
    b, v = samples[base], samples[var]
    return dict(median_pct=100.0 * (statistics.median(v) / statistics.median(b) - 1.0),
                min_pct=100.0 * (min(v) / min(b) - 1.0),
                paired_pct=100.0 * (statistics.median([x / y for x, y in zip(v, b)]) - 1.0),
                spread_pct=max(100.0 * (max(s) - min(s)) / statistics.median(s) for s in (b, v)))


def _ratio(samples, num, den):
    if num not in samples or den not in samples:
        return None
    return statistics.median(samples[num]) / statistics.median(samples[den])


def _f(x, spec, suffix=""):
    return "—" if x is None else format(x, spec) + suffix


# ---------------------------------------------------------------------------------------------
# rows


def _separate_max(q, k, causal, scale):
    """What users do today: recompute the logits to get the per-head max."""
    N, K = q.shape[2], k.shape[2]
    k = jnp.repeat(k, N // K, axis=2)
    s = jnp.einsum("btnh,bsnh->bnts", q, k, preferred_element_type=jnp.float32) * scale
    if causal:
        T, S = q.shape[1], k.shape[1]
        s = jnp.where(jnp.arange(S)[None, :] <= jnp.arange(T)[:, None], s, -jnp.inf)
    return jnp.max(s, axis=(0, 2, 3))


def _inputs(B, T, N, K, H, seed=0):
    rng = np.random.default_rng(seed)
    q = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((B, T, K, H)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((B, T, K, H)), jnp.bfloat16)
    ct = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.bfloat16)
    return rng, q, k, v, ct


def _loss_grad(f, argnums=(0, 1, 2)):
    """grad of <out, ct> for f(q, k, v, *extra) -> out; ct is the 4th positional argument."""
    def loss(q, k, v, ct, *extra):
        return jnp.sum((f(q, k, v, *extra) * ct).astype(jnp.float32))
    return jax.grad(loss, argnums=argnums)


def _fa3():
    """flash_attn3_jax.flash_mha, or None when the benchmark-only wheel is not installed."""
    try:
        from flash_attn3_jax import flash_mha
    except Exception:  # ImportError, or the wheel's CUDA runtime failing to load
        return None
    return flash_mha


def bench_row(B, T, N, K, H, causal, opts):
    _, q, k, v, ct = _inputs(B, T, N, K, H)
    scale = 1.0 / np.sqrt(H)

    def mx(q, k, v, **kw):
        return maxattn.dot_product_attention(q, k, v, is_causal=causal, implementation=opts.impl, **kw)

    def jx(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation=opts.peer)

    qkv, qkvc = (q, k, v), (q, k, v, ct)
    variants = {
        "fwd": (jax.jit(lambda q, k, v: mx(q, k, v)), qkv),
        "fwd+max": (jax.jit(lambda q, k, v: mx(q, k, v, return_max_logit=True)), qkv),
        "fwd+lse": (jax.jit(lambda q, k, v: mx(q, k, v, return_lse=True)), qkv),
        "fwd+lse+max": (jax.jit(lambda q, k, v: mx(q, k, v, return_lse=True, return_max_logit=True)), qkv),
        "fwd+bwd": (jax.jit(_loss_grad(lambda q, k, v: mx(q, k, v))), qkvc),
    }
    if opts.peer:
        variants.update({
            "jax fwd": (jax.jit(jx), qkv),
            "jax fwd+bwd": (jax.jit(_loss_grad(jx)), qkvc),
            "jax+max": (jax.jit(lambda q, k, v: (jx(q, k, v), _separate_max(q, k, causal, scale))), qkv),
        })
    fa3 = _fa3() if opts.fa3 else None
    if fa3 is not None:
        fa = lambda q, k, v: fa3(q, k, v, softmax_scale=float(scale), is_causal=causal)
        variants.update({"fa3 fwd": (jax.jit(fa), qkv), "fa3 fwd+bwd": (jax.jit(_loss_grad(fa)), qkvc)})
    samples, compile_s, errors = _run(variants, ROW_GROUPS, opts.calls, opts.reps, opts.warmup, opts.settle_s)
    stats = _stats(samples)
    med = {n: s["median_ms"] / 1e3 for n, s in stats.items()}
    flops = 4.0 * B * N * T * T * H * (0.5 if causal else 1.0)
    inf = _overhead(samples, *OVERHEADS["inference"])
    return dict(
        shape=dict(B=B, T=T, N=N, K=K, H=H, causal=causal),
        ms={n: s["median_ms"] for n, s in stats.items()},
        stats=stats, compile_s=compile_s, errors=errors,
        tflops_fwd=flops / med["fwd"] / 1e12 if "fwd" in med else None,
        tflops_fwd_bwd=3.5 * flops / med["fwd+bwd"] / 1e12 if "fwd+bwd" in med else None,
        max_overhead_pct=inf["median_pct"] if inf else None,
        overhead={kind: _overhead(samples, *pair) for kind, pair in OVERHEADS.items()},
        fwd_vs_jax=_ratio(samples, "jax fwd", "fwd"),
        fwd_bwd_vs_jax=_ratio(samples, "jax fwd+bwd", "fwd+bwd"),
        max_vs_jax_plus_pass=_ratio(samples, "jax+max", "fwd+max"),
        fwd_vs_fa3=_ratio(samples, "fa3 fwd", "fwd"),
        fwd_max_vs_fa3=_ratio(samples, "fa3 fwd", "fwd+max"),
        fwd_bwd_vs_fa3=_ratio(samples, "fa3 fwd+bwd", "fwd+bwd"),
        spread_pct={n: s["spread_pct"] for n, s in stats.items()},
    )


MAIN_HEADER = ("| B | T | N | K | H | causal | fwd ms | fwd+max ms | max ovh % | fwd TFLOP/s | fwd+bwd ms "
               "| fwd+bwd TFLOP/s | jax fwd ms | jax fwd+bwd ms | jax+max ms | fwd vs jax | fwd+bwd vs jax "
               "| fwd+max vs jax+max |")
OVH_HEADER = ("| B | T | N | K | H | causal | fwd ms | fwd+max ms | inference ovh % median / min / paired "
              "| fwd+lse ms | fwd+lse+max ms | training ovh % median / min / paired | spread % (max of pair) "
              f"| ≤{TARGET_OVERHEAD_PCT:g}% (inf / train, median) |")


FA3_HEADER = ("| B | T | N | K | H | causal | fwd ms | fwd+max ms | FA3 fwd ms | fwd vs FA3 | fwd+max vs FA3 "
              "| fwd+bwd ms | FA3 fwd+bwd ms | fwd+bwd vs FA3 |")


def _fa3_line(r):
    ms = r["ms"]
    return (_shape_cells(r["shape"]) + f"| {_f(ms.get('fwd'), '.3f')} | {_f(ms.get('fwd+max'), '.3f')} "
            f"| {_f(ms.get('fa3 fwd'), '.3f')} | {_f(r['fwd_vs_fa3'], '.3f', 'x')} "
            f"| {_f(r['fwd_max_vs_fa3'], '.3f', 'x')} | {_f(ms.get('fwd+bwd'), '.3f')} "
            f"| {_f(ms.get('fa3 fwd+bwd'), '.3f')} | {_f(r['fwd_bwd_vs_fa3'], '.3f', 'x')} |")


def _shape_cells(s):
    return f"| {s['B']} | {s['T']} | {s['N']} | {s['K']} | {s['H']} | {s['causal']} "


def _main_line(r):
    ms = r["ms"]
    return (_shape_cells(r["shape"]) + f"| {_f(ms.get('fwd'), '.3f')} | {_f(ms.get('fwd+max'), '.3f')} "
            f"| {_f(r['max_overhead_pct'], '+.1f')} | {_f(r['tflops_fwd'], '.0f')} | {_f(ms.get('fwd+bwd'), '.3f')} "
            f"| {_f(r['tflops_fwd_bwd'], '.0f')} | {_f(ms.get('jax fwd'), '.3f')} "
            f"| {_f(ms.get('jax fwd+bwd'), '.3f')} | {_f(ms.get('jax+max'), '.3f')} "
            f"| {_f(r['fwd_vs_jax'], '.3f', 'x')} | {_f(r['fwd_bwd_vs_jax'], '.3f', 'x')} "
            f"| {_f(r['max_vs_jax_plus_pass'], '.2f', 'x')} |")


def _ovh_line(r):
    ms, o = r["ms"], r["overhead"]

    def three(x):
        return "—" if x is None else f"{x['median_pct']:+.2f} / {x['min_pct']:+.2f} / {x['paired_pct']:+.2f}"

    def met(x):
        return "—" if x is None else ("yes" if x["median_pct"] <= TARGET_OVERHEAD_PCT else "no")

    spreads = [x["spread_pct"] for x in o.values() if x]
    return (_shape_cells(r["shape"]) + f"| {_f(ms.get('fwd'), '.3f')} | {_f(ms.get('fwd+max'), '.3f')} "
            f"| {three(o['inference'])} | {_f(ms.get('fwd+lse'), '.3f')} | {_f(ms.get('fwd+lse+max'), '.3f')} "
            f"| {three(o['training'])} | {_f(max(spreads) if spreads else None, '.1f')} "
            f"| {met(o['inference'])} / {met(o['training'])} |")


# ---------------------------------------------------------------------------------------------
# features


def _feature_specs(B, T, N, rng):
    seg = np.broadcast_to(1 + np.arange(T) // (T // 4), (B, T))  # ids 1..4; 0 would mean padding
    seg = jnp.asarray(seg, jnp.int32)
    sinks = jnp.asarray(rng.standard_normal(N), jnp.float32)
    key = jax.random.key(0)
    # (name, extra arrays, kwargs from the extra arrays, return_max_logit, extra args differentiable)
    return [
        ("baseline", (), lambda: {}, False, False),
        ("baseline + max_logit", (), lambda: {}, True, False),
        ("dropout 0.1", (key,), lambda r: dict(dropout_rate=0.1, dropout_rng=r), False, False),
        ("learnable sinks", (sinks,), lambda s: dict(softmax_type="learnable", sink_logits=s), False, True),
        ("learnable sinks + max_logit", (sinks,), lambda s: dict(softmax_type="learnable", sink_logits=s),
         True, True),
        ("packed, 4 segments", (seg,), lambda s: dict(q_segment_ids=s, kv_segment_ids=s), False, False),
        ("soft cap 50", (), lambda: dict(logits_soft_cap=50.0), False, False),
        ("soft cap 50 + max_logit", (), lambda: dict(logits_soft_cap=50.0), True, False),
    ]


def bench_features(B, T, N, K, H, opts):
    rng, q, k, v, ct = _inputs(B, T, N, K, H, seed=1)
    specs = _feature_specs(B, T, N, rng)
    variants, groups = {}, []
    for name, extra, kwargs_of, want_max, diff_extra in specs:
        def attn(q, k, v, *extra, kwargs_of=kwargs_of, want_max=want_max):
            return maxattn.dot_product_attention(q, k, v, is_causal=True, implementation=opts.impl,
                                                 return_max_logit=want_max, **kwargs_of(*extra))

        def loss(q, k, v, ct, *extra, attn=attn, want_max=want_max):
            res = attn(q, k, v, *extra)
            out, aux = res if want_max else (res, None)
            return jnp.sum((out * ct).astype(jnp.float32)), (aux["max_logit"] if want_max else None)

        argnums = (0, 1, 2) + tuple(range(4, 4 + len(extra))) if diff_extra else (0, 1, 2)
        variants[name + " fwd"] = (jax.jit(attn), (q, k, v) + extra)
        variants[name + " fwd+bwd"] = (jax.jit(jax.grad(loss, argnums=argnums, has_aux=True)), (q, k, v, ct) + extra)
        groups.append([name + " fwd", name + " fwd+bwd"])
    samples, compile_s, errors = _run(variants, groups, opts.calls, opts.reps, opts.warmup, opts.settle_s)
    stats = _stats(samples)
    entries = []
    for name, *_ in specs:
        e = dict(feature=name)
        for kind in ("fwd", "fwd+bwd"):
            v = f"{name} {kind}"
            e[kind] = stats.get(v)
            e[kind + " error"] = errors.get(v)
            e[kind + " compile_s"] = compile_s.get(v)
            e[kind + " vs baseline"] = _ratio(samples, v, f"baseline {kind}")
        entries.append(e)
    return dict(shape=dict(B=B, T=T, N=N, K=K, H=H, causal=True), entries=entries)


def _feature_lines(res):
    lines = ["| feature | fwd ms | fwd cost vs baseline | fwd+bwd ms | fwd+bwd cost vs baseline | spread % | note |",
             "|---|---|---|---|---|---|---|"]
    for e in res["entries"]:
        cells, notes, spreads = [], [], []
        for kind in ("fwd", "fwd+bwd"):
            st = e[kind]
            cells += [_f(st["median_ms"] if st else None, ".3f"), _f(e[kind + " vs baseline"], ".3f", "x")]
            if st:
                spreads.append(st["spread_pct"])
        errs = {kind: e[kind + " error"] for kind in ("fwd", "fwd+bwd") if e[kind + " error"]}
        if len(errs) == 2 and len(set(errs.values())) == 1:
            notes.append(errs["fwd"])
        else:
            notes += [f"{kind}: {msg}" for kind, msg in errs.items()]
        lines.append(f"| {e['feature']} | " + " | ".join(cells) +
                     f" | {_f(max(spreads) if spreads else None, '.1f')} | {'; '.join(notes).replace('|', '/')} |")
    return lines


# ---------------------------------------------------------------------------------------------
# main


def _versions(opts):
    info = dict(device=jax.devices()[0].device_kind, platform=jax.devices()[0].platform,
                jax=jax.__version__, python=platform.python_version(), numpy=np.__version__,
                impl=opts.impl, peer=opts.peer, dtype="bfloat16")
    try:
        import jaxlib
        info["jaxlib"] = getattr(jaxlib, "__version__", None) or jaxlib.version.__version__
    except Exception as e:
        info["jaxlib"] = _reason(e)
    try:
        from maxattn._src.backends import cudnn as backend
        info["cudnn"] = backend.cudnn_version()
    except Exception as e:
        info["cudnn"] = _reason(e)
    for dist in ("jax-cuda13-plugin", "jax-cuda12-plugin", "nvidia-cudnn-cu13", "nvidia-cudnn-cu12",
                 "nvidia-cudnn-frontend"):
        try:
            info[dist] = importlib.metadata.version(dist)
        except Exception:
            pass
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        git = ["git", "-C", here]
        info["commit"] = subprocess.run(git + ["rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                        timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(git + ["status", "--porcelain", "--untracked-files=no"], capture_output=True,
                               text=True, timeout=10).stdout.strip()
        info["dirty"] = bool(dirty)
    except Exception:
        info["commit"] = None
    return info


def _parse_rows(spec, rows):
    if spec in ("all", ""):
        return list(range(len(rows)))
    if spec == "none":
        return []
    idx = [int(x) for x in spec.split(",")]
    for i in idx:
        if not 0 <= i < len(rows):
            raise SystemExit(f"--rows: index {i} out of range 0..{len(rows) - 1}")
    return idx


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--calls", type=int, default=None, help="jitted calls per timed sample (50; smoke 3)")
    p.add_argument("--reps", type=int, default=None, help="timed repetitions (7; smoke 3)")
    p.add_argument("--warmup", type=int, default=1, help="untimed repetitions before the timed ones")
    p.add_argument("--settle-s", type=float, default=None,
                   help="untimed running of a variant before each of its samples, seconds (0.2; smoke 0)")
    p.add_argument("--rows", default="all", help="comma-separated row indices into ROWS, 'all' or 'none'")
    p.add_argument("--skip-features", action="store_true")
    p.add_argument("--impl", default=None, help='maxattn implementation ("cudnn"; smoke "cpu")')
    p.add_argument("--peer", default=None,
                   help='jax.nn.dot_product_attention implementation for the jax columns ("cudnn"; smoke "xla"; '
                        '"none" skips them)')
    p.add_argument("--budget-s", type=float, default=320.0,
                   help="start no new row / feature table after this many seconds since start")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU: impl cpu, peer xla")
    p.add_argument("--no-fa3", dest="fa3", action="store_false",
                   help="skip the FlashAttention-3 columns (they run when flash_attn3_jax is importable)")
    p.add_argument("--json", default=None)
    opts = p.parse_args(argv)
    opts.calls = opts.calls or (3 if opts.smoke else 50)
    opts.reps = opts.reps or (3 if opts.smoke else 7)
    opts.settle_s = opts.settle_s if opts.settle_s is not None else (0.0 if opts.smoke else 0.2)
    opts.impl = opts.impl or ("cpu" if opts.smoke else "cudnn")
    opts.peer = opts.peer or ("xla" if opts.smoke else "cudnn")
    opts.peer = None if opts.peer == "none" else opts.peer
    rows = SMOKE_ROWS if opts.smoke else ROWS
    feature_shape = SMOKE_FEATURE_SHAPE if opts.smoke else FEATURE_SHAPE

    info = _versions(opts)
    report = dict(info=info, argv=sys.argv[1:], calls=opts.calls, reps=opts.reps, warmup=opts.warmup,
                  settle_s=opts.settle_s, target_overhead_pct=TARGET_OVERHEAD_PCT, results=[], features=None,
                  skipped=[], failures=[])

    def dump():
        report["total_s"] = _elapsed()
        if opts.json:
            with open(opts.json, "w") as f:
                json.dump(report, f, indent=1)

    print(f"# maxattn GPU benchmark: {json.dumps(info)}", flush=True)
    print(f"# bf16; sample = {opts.settle_s:g} s untimed, then {opts.calls} calls + 1 sync; "
          f"{opts.reps} interleaved reps (+{opts.warmup} warm-up); median unless noted", flush=True)

    for i in _parse_rows(opts.rows, rows):
        if _elapsed() > opts.budget_s:
            report["skipped"].append(dict(row=rows[i], reason=f"budget {opts.budget_s:.0f} s reached"))
            print(f"# skipped row {rows[i]}: budget reached at {_elapsed():.0f} s", flush=True)
            continue
        t = _elapsed()
        try:
            r = bench_row(*rows[i], opts=opts)
        except Exception as e:
            report["failures"].append(dict(row=rows[i], error=_reason(e), traceback=traceback.format_exc()))
            print(f"# row {rows[i]} failed: {_reason(e)}", flush=True)
            dump()
            continue
        r["wall_s"] = _elapsed() - t
        report["results"].append(r)
        print(f"# row {rows[i]}: {r['wall_s']:.1f} s (compile {sum(r['compile_s'].values()):.1f} s)"
              + (f"; errors: {r['errors']}" if r["errors"] else ""), flush=True)
        dump()

    results = report["results"]
    if results:
        print(f"\n## vs jax.nn.dot_product_attention(implementation={opts.peer!r})\n")
        print(MAIN_HEADER)
        print("|" + "---|" * (MAIN_HEADER.count("|") - 1))
        for r in results:
            print(_main_line(r))
        if any(r["ms"].get("fa3 fwd") is not None for r in results):
            print("\n## vs FlashAttention-3 (flash-attn3-jax flash_mha, same run; ratio = FA3 time / ours)\n")
            print(FA3_HEADER)
            print("|" + "---|" * (FA3_HEADER.count("|") - 1))
            for r in results:
                print(_fa3_line(r))
        print(f"\n## max_logit overhead (target ≤ {TARGET_OVERHEAD_PCT:g}% of our own forward)\n")
        print(OVH_HEADER)
        print("|" + "---|" * (OVH_HEADER.count("|") - 1))
        for r in results:
            print(_ovh_line(r))
        print("\nrepetition spread (max-min)/median %:")
        for r in results:
            s = r["shape"]
            print(f"  {(s['B'], s['T'], s['N'], s['K'], s['H'], s['causal'])}: "
                  + ", ".join(f"{n} {x:.1f}" for n, x in r["spread_pct"].items()))
        sys.stdout.flush()

    if not opts.skip_features:
        if _elapsed() > opts.budget_s:
            report["skipped"].append(dict(features=feature_shape, reason=f"budget {opts.budget_s:.0f} s reached"))
            print(f"\n# skipped the features table: budget reached at {_elapsed():.0f} s", flush=True)
        else:
            t = _elapsed()
            try:
                res = bench_features(*feature_shape, opts=opts)
                res["wall_s"] = _elapsed() - t
                report["features"] = res
                print(f"\n## features at {feature_shape} bf16 causal ({res['wall_s']:.1f} s)\n")
                print("\n".join(_feature_lines(res)), flush=True)
            except Exception as e:
                report["failures"].append(dict(features=feature_shape, error=_reason(e),
                                               traceback=traceback.format_exc()))
                print(f"\n# features table failed: {_reason(e)}", flush=True)
    dump()
    print(f"\n# total {_elapsed():.1f} s", flush=True)


if __name__ == "__main__":
    main()

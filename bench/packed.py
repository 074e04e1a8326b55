"""Packed rows on the GPU: segment ids as ragged sequences vs the same work unpacked, and FA3 varlen.

For each (B, T, N, K, H, D) row -- B rows of T tokens, each D equal causal documents -- times, in one
interleaved run (bench/gpu.py's timing: jitted calls after a settle, median of the repetitions):
  * ``ragged``: maxattn with segment ids and ``max_segments_per_row=D`` (cuDNN ragged sequences);
  * ``dense``: maxattn with the same segment ids and no bound -- only up to T = 8192. On ``cudnn``
    that is a dense [B, 1, T, T] bias; with ``--impl sm90`` it is the kernel's own segment-id path
    (cross-document tiles skipped, no bias, in the forward and, at head dims 64 and 128, in the
    backward), and ``ragged`` is refused there (the sm90 backend takes no bound);
  * ``unpacked``: maxattn on the same work as (B * D, T / D) rows, no segment ids;
  * ``fa3 varlen``: flash-attn3-jax ``flash_mha_varlen`` on the same packing (when installed).
Forward with max_logit and lse (what QK-Clip training reads), and forward+backward. Also the peak
device memory of one ragged forward+backward (``memory_stats``), and ratios against the unpacked
call and FA3 varlen from the same run.

  python3 bench/packed.py [--rows 0,1] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu import _run  # noqa: E402  (bench/gpu.py's timing)

import maxattn  # noqa: E402

# (B, T, N, K, H, documents per row)
ROWS = [
    (2, 8192, 16, 16, 128, 1),
    (2, 8192, 16, 16, 128, 4),
    (2, 8192, 16, 16, 128, 8),
    (2, 8192, 16, 16, 128, 16),
    (4, 4096, 32, 8, 128, 4),
    (1, 32768, 16, 16, 128, 16),
    (1, 65536, 16, 16, 128, 16),
]
DENSE_MAX_T = 8192  # the dense [B, 1, T, T] bias beyond this is the O(T^2) cost the ragged path removes


def _fa3_varlen():
    try:
        from flash_attn3_jax import flash_mha_varlen
    except Exception:
        return None
    return flash_mha_varlen


def _variants(B, T, N, K, H, D, impl):
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((B, T, K, H)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((B, T, K, H)), jnp.bfloat16)
    ct = jnp.asarray(rng.standard_normal((B, T, N, H)), jnp.bfloat16)
    L = T // D
    ids = jnp.asarray(np.repeat(np.arange(1, D + 1, dtype=np.int32), L)[None].repeat(B, 0))
    seg = dict(q_segment_ids=ids, kv_segment_ids=ids)

    def attn(**kw):
        def f(q, k, v):
            out, aux = maxattn.dot_product_attention(q, k, v, is_causal=True, implementation=impl,
                                                     return_max_logit=True, return_lse=True, **kw)
            return out, aux["max_logit"]
        return f

    def fwdbwd(f):
        def loss(q, k, v, ct):
            return jnp.sum(f(q, k, v)[0].astype(jnp.float32) * ct.astype(jnp.float32))
        return jax.jit(jax.grad(loss, argnums=(0, 1, 2)))

    unpack = lambda x: x.reshape(B * D, L, *x.shape[2:])
    out = {}
    for name, f, args in [("ragged", attn(max_segments_per_row=D, **seg), (q, k, v)),
                          ("dense", attn(**seg), (q, k, v)),
                          ("unpacked", attn(), tuple(unpack(x) for x in (q, k, v)))]:
        if name == "dense" and T > DENSE_MAX_T:
            continue
        out[name + " fwd"] = (jax.jit(f), args)
        out[name + " fwd+bwd"] = (fwdbwd(f), args + ((ct,) if name != "unpacked" else (unpack(ct),)))
    varlen = _fa3_varlen()
    if varlen is not None:
        cu = jnp.arange(0, B * T + 1, L, dtype=jnp.int32)
        flat = lambda x: x.reshape(B * T, *x.shape[2:])
        fa = lambda q, k, v: (varlen(q, k, v, cu, cu, max_seqlen_q=L, max_seqlen_k=L, is_causal=True),)
        out["fa3 varlen fwd"] = (jax.jit(fa), tuple(flat(x) for x in (q, k, v)))
        out["fa3 varlen fwd+bwd"] = (fwdbwd(fa), tuple(flat(x) for x in (q, k, v, ct)))
    return out


def _peak_bytes(fn, args):
    dev = jax.devices()[0]
    stats = dev.memory_stats() or {}
    if "peak_bytes_in_use" not in stats:
        return None
    before = stats.get("bytes_in_use", 0)
    jax.block_until_ready(fn(*args))
    return dev.memory_stats()["peak_bytes_in_use"] - before


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", default="all")
    p.add_argument("--impl", default="cudnn")
    p.add_argument("--calls", type=int, default=20)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--settle-s", type=float, default=0.2,
                   help="untimed running of a variant before each of its samples, seconds (bench/gpu.py's)")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    rows = ROWS if a.rows == "all" else [ROWS[int(i)] for i in a.rows.split(",")]
    print(f"jax {jax.__version__}, {jax.devices()[0].device_kind}, impl {a.impl}, "
          f"fa3 varlen {'yes' if _fa3_varlen() else 'no'}; median ms of {a.reps} x {a.calls} calls, "
          f"each sample after {a.settle_s:g} s of untimed calls")
    results = []
    for B, T, N, K, H, D in rows:
        variants = _variants(B, T, N, K, H, D, a.impl)
        calls = max(2, a.calls // max(1, T // 8192))
        groups = [[n for n in variants if n.endswith(" fwd")], [n for n in variants if n.endswith("fwd+bwd")]]
        samples, _, errors = _run(variants, groups, calls, a.reps, 1, a.settle_s)
        med = {n: statistics.median(s) * 1e3 for n, s in samples.items()}
        peak = _peak_bytes(*variants["ragged fwd+bwd"]) if "ragged fwd+bwd" in samples else None
        r = dict(shape=[B, T, N, K, H], docs=D, median_ms=med, errors=errors, ragged_fwdbwd_peak_bytes=peak)
        results.append(r)
        line = f"B={B} T={T} N={N} K={K} H={H} docs={D}:"
        for kind in ("fwd", "fwd+bwd"):
            cells = [f"{n.split(' ')[0] if not n.startswith('fa3') else 'fa3'} {med[n]:.3f}"
                     for n in med if n.endswith(" " + kind)]
            unp, fa = (med.get(f"{x} {kind}") for x in ("unpacked", "fa3 varlen"))
            ratios = []
            for packed in ("ragged", "dense"):
                t = med.get(f"{packed} {kind}")
                if t and unp:
                    ratios.append(f"{packed}/unpacked {t / unp:.2f}x")
                if t and fa:
                    ratios.append(f"{packed}/fa3 {t / fa:.2f}x")
            line += f"\n  {kind:8s} " + ", ".join(cells) + ("  | " + ", ".join(ratios) if ratios else "")
        if peak is not None:
            line += f"\n  process peak device memory after ragged fwd+bwd: {peak / 2**20:.0f} MiB"
        for n, e in errors.items():
            line += f"\n  {n}: {e}"
        print(line, flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(rows=results, jax=jax.__version__), f, indent=1)


if __name__ == "__main__":
    main()

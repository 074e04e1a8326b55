"""CPU benchmark: maxattn "cpu" vs XLA attention vs XLA + a separate max-logit pass.

Run: .venv/bin/python bench/cpu.py [--quick]

For each shape it times, in one process and the same run:
  * maxattn cpu forward without and with max_logit (the max_logit overhead),
  * jax.nn.dot_product_attention(implementation="xla") forward,
  * the XLA path plus a separate pass that recomputes q.k^T for the max logit
    (what a JAX user does today),
  * forward+backward of maxattn and of XLA,
and prints ratios. Times are the best of several interleaved rounds. Peak memory of each
forward is measured in a fresh subprocess as the growth of the peak resident
set size (VmHWM, reset just before the call) over the resident size before it.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

import maxattn


def _inputs(B, T, N, H, dtype=jnp.float32, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.standard_normal((B, T, N, H)), dtype) for _ in range(3))


def _fns(causal: bool):
    def ours(q, k, v):
        return maxattn.dot_product_attention(q, k, v, is_causal=causal, implementation="cpu")

    def ours_max(q, k, v):
        return maxattn.dot_product_attention(q, k, v, is_causal=causal, implementation="cpu",
                                             return_max_logit=True)

    def xla(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla")

    def xla_max(q, k, v):
        out = jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="xla")
        s = jnp.einsum("btnh,bsnh->bnts", q, k) / np.sqrt(q.shape[-1])
        if causal:
            T, S = q.shape[1], k.shape[1]
            s = jnp.where(jnp.tril(jnp.ones((T, S), bool)), s, -jnp.inf)
        return out, jnp.max(s, axis=(0, 2, 3))

    def grad_of(f):
        def loss(q, k, v):
            o = f(q, k, v)
            o = o[0] if isinstance(o, tuple) else o
            return jnp.sum(o.astype(jnp.float32) ** 2)
        return jax.grad(loss, argnums=(0, 1, 2))

    return {"ours": ours, "ours+max": ours_max, "xla": xla, "xla+max pass": xla_max,
            "ours fwd+bwd": grad_of(ours_max), "xla fwd+bwd": grad_of(xla)}


def _time_all(fns: dict, args, rounds: int = 7) -> dict[str, float]:
    """Best-of-`rounds` seconds per function, rounds interleaved across functions.

    Interleaving and taking the minimum keeps the ratios fair on a machine
    whose load changes during the run.
    """
    compiled = {name: jax.jit(f) for name, f in fns.items()}
    for f in compiled.values():
        jax.block_until_ready(f(*args))  # compile + warm up
    best = {name: float("inf") for name in fns}
    for _ in range(rounds):
        for name, f in compiled.items():
            t0 = time.perf_counter()
            jax.block_until_ready(f(*args))
            best[name] = min(best[name], time.perf_counter() - t0)
    return best


def _rss_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _peak_memory_child(name, B, T, N, H, causal) -> None:
    """Runs in a subprocess: prints the peak-RSS growth (MiB) of one call."""
    args = _inputs(B, T, N, H)
    f = jax.jit(_fns(causal)[name]).lower(*args).compile()
    jax.block_until_ready(args)
    with open("/proc/self/clear_refs", "w") as clear:
        clear.write("5")  # resets the peak resident set size (VmHWM) to the current one
    before = _rss_kib("VmRSS")
    jax.block_until_ready(f(*args))
    print(json.dumps({"peak_mib": (_rss_kib("VmHWM") - before) / 1024.0}))


def peak_memory_mib(name, B, T, N, H, causal) -> float:
    out = subprocess.run([sys.executable, __file__, "--child", json.dumps([name, B, T, N, H, causal])],
                         check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["peak_mib"]


def flops(B, T, N, H, causal, bwd=False) -> float:
    f = 4.0 * B * N * T * T * H * (0.5 if causal else 1.0)
    return f * (3.5 if bwd else 1.0)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small shapes only (smoke run)")
    p.add_argument("--long", type=int, default=32768, help="length of the bounded-memory run (0 = skip)")
    p.add_argument("--child", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.child:
        _peak_memory_child(*json.loads(a.child))
        return

    print(f"# maxattn CPU benchmark  {time.strftime('%Y-%m-%d')}  jax {jax.__version__}  "
          f"python {platform.python_version()}  {os.cpu_count()} cpus  {platform.processor() or platform.machine()}")
    shapes = [(1, 512, 8, 64)] if a.quick else [(1, 2048, 8, 64), (2, 1024, 8, 128)]
    for (B, T, N, H) in shapes:
        for causal in (False, True):
            args = _inputs(B, T, N, H)
            fns = _fns(causal)
            t = _time_all(fns, args)
            mem = {name: peak_memory_mib(name, B, T, N, H, causal) for name in ("ours+max", "xla", "xla+max pass")}
            print(f"\n## B={B} T=S={T} N={N} H={H} float32 {'causal' if causal else 'non-causal'}")
            print(f"{'method':<16}{'ms':>10}{'GFLOP/s':>10}{'peak MiB':>10}")
            for name, sec in t.items():
                gf = flops(B, T, N, H, causal, bwd="bwd" in name) / sec / 1e9
                m = f"{mem[name]:10.1f}" if name in mem else f"{'':>10}"
                print(f"{name:<16}{sec * 1e3:10.2f}{gf:10.1f}{m}")
            print(f"forward speed-up vs xla:               {t['xla'] / t['ours']:.2f}x")
            print(f"max_logit overhead (ours+max / ours):  {100 * (t['ours+max'] / t['ours'] - 1):+.1f}%")
            print(f"ours+max vs xla + separate max pass:   {t['xla+max pass'] / t['ours+max']:.2f}x faster")
            print(f"fwd+bwd speed-up vs xla:               {t['xla fwd+bwd'] / t['ours fwd+bwd']:.2f}x")
    if a.long and not a.quick:
        B, T, N, H = 1, a.long, 2, 64
        sec = _time_all({"ours+max": _fns(True)["ours+max"]}, _inputs(B, T, N, H), rounds=1)["ours+max"]
        mib = peak_memory_mib("ours+max", B, T, N, H, True)
        logits_mib = B * N * T * T * 4 / 2**20
        print(f"\n## bounded memory: B={B} T=S={T} N={N} H={H} causal, ours+max: {sec:.2f} s, "
              f"peak growth {mib:.0f} MiB (the f32 logits alone would be {logits_mib:.0f} MiB)")


if __name__ == "__main__":
    main()

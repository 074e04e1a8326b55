"""Demo: QK-Clip keeps attention logits at the threshold while training a small LM.

Trains a small decoder-only byte-level transformer (Flax nnx, attention through
``maxattn.flax.attention_fn``) on the Python standard library's own source code,
twice: without and with QK-Clip. Every layer's per-head max logit is recorded at
each step through ``sow``; the script prints a summary table and writes a PNG.

Run: ``python -m maxattn.demo`` (or ``maxattn-demo``); ``--help`` for options.
"""

from __future__ import annotations

import argparse
import os
import sys
import sysconfig
import time
from typing import Optional

import numpy as np

# Fixed list of stdlib modules (present on every CPython install): the corpus.
_CORPUS_FILES = [
    "argparse.py", "ast.py", "bisect.py", "calendar.py", "collections/__init__.py",
    "configparser.py", "contextlib.py", "copy.py", "csv.py", "dataclasses.py", "datetime.py",
    "decimal.py", "difflib.py", "enum.py", "fractions.py", "functools.py", "gettext.py",
    "glob.py", "heapq.py", "inspect.py", "ipaddress.py", "json/decoder.py", "json/encoder.py",
    "logging/__init__.py", "os.py", "pathlib.py", "pickle.py", "pprint.py", "random.py",
    "shutil.py", "statistics.py", "string.py", "subprocess.py", "tarfile.py", "textwrap.py",
    "threading.py", "typing.py", "unittest/case.py", "uuid.py", "zipfile.py",
]


def load_corpus(max_bytes: int = 4_000_000) -> np.ndarray:
    """Bytes of a fixed list of stdlib source files, as uint8 [n]."""
    root = sysconfig.get_paths()["stdlib"]
    chunks = []
    for rel in _CORPUS_FILES:
        for cand in (os.path.join(root, rel), os.path.join(root, rel.replace("/__init__.py", ".py"))):
            if os.path.isfile(cand):
                with open(cand, "rb") as f:
                    chunks.append(f.read())
                break
    data = b"\n".join(chunks)[:max_bytes]
    if len(data) < 100_000:  # stripped-down install: fall back to this package's own source
        import maxattn
        pkg = os.path.dirname(maxattn.__file__)
        for dirpath, _, files in os.walk(pkg):
            for name in sorted(files):
                if name.endswith(".py"):
                    with open(os.path.join(dirpath, name), "rb") as f:
                        data += f.read()
    return np.frombuffer(data, dtype=np.uint8)


def build_model(args, seed: int):
    """A pre-LN decoder-only transformer whose attention is maxattn (nnx)."""
    from flax import nnx

    import maxattn.flax as mf

    attention_fn = mf.make_attention_fn(is_causal=True)

    class Block(nnx.Module):
        def __init__(self, rngs):
            d = args.d_model
            self.ln1 = nnx.LayerNorm(d, rngs=rngs)
            self.attn = nnx.MultiHeadAttention(
                num_heads=args.heads, in_features=d, qkv_features=d, decode=False,
                attention_fn=attention_fn, rngs=rngs)
            self.ln2 = nnx.LayerNorm(d, rngs=rngs)
            self.fc1 = nnx.Linear(d, 4 * d, rngs=rngs)
            self.fc2 = nnx.Linear(4 * d, d, rngs=rngs)

        def __call__(self, x):
            # sow_weights=True makes the layer pass itself to attention_fn, which sows max_logit
            x = x + self.attn(self.ln1(x), sow_weights=True)
            return x + self.fc2(nnx.gelu(self.fc1(self.ln2(x))))

    blocks_cls = getattr(nnx, "List", list)

    class LM(nnx.Module):
        def __init__(self, rngs):
            self.embed = nnx.Embed(256, args.d_model, rngs=rngs)
            self.pos = nnx.Embed(args.seq_len, args.d_model, rngs=rngs)
            self.blocks = blocks_cls([Block(rngs) for _ in range(args.layers)])
            self.ln = nnx.LayerNorm(args.d_model, rngs=rngs)
            self.head = nnx.Linear(args.d_model, 256, rngs=rngs)

        def __call__(self, tokens):
            import jax.numpy as jnp
            x = self.embed(tokens) + self.pos(jnp.arange(tokens.shape[1]))[None]
            for blk in self.blocks:
                x = blk(x)
            return self.head(self.ln(x))

    return LM(nnx.Rngs(seed))


def train(args, clip: bool, data: np.ndarray, desc: str):
    """One training run. Returns dict(losses [steps], max_logits [steps, L, N], clipped [steps])."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx
    from tqdm.auto import tqdm

    import maxattn.flax as mf
    from maxattn.qk_clip import qk_clip_transform

    model = build_model(args, args.seed)
    graphdef, params, rest = nnx.split(model, nnx.Param, ...)
    layers = [("blocks", i, "attn") for i in range(args.layers)]
    parts = [optax.clip_by_global_norm(1.0), optax.adam(args.lr)]
    if clip:
        parts.append(qk_clip_transform(args.threshold, alpha=0.5))
    tx = optax.chain(*parts)
    opt_state = tx.init(params)

    def loss_fn(params, rest, batch):
        model = nnx.merge(graphdef, params, rest)
        logits, ml = mf.capture_max_logits(lambda m, x: m(x), model, batch[:, :-1])
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()
        return loss, ml

    @jax.jit
    def step(params, rest, opt_state, batch):
        (loss, ml), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, rest, batch)
        updates, opt_state = tx.update(grads, opt_state, params, max_logits=ml)
        params = optax.apply_updates(params, updates)
        return params, opt_state, loss, jnp.stack([ml[k] for k in layers])

    rng = np.random.default_rng(args.seed)
    losses, maxes = [], []
    bar = tqdm(range(args.steps), desc=desc, disable=args.quiet, dynamic_ncols=True)
    for i in bar:
        starts = rng.integers(0, len(data) - args.seq_len - 1, size=args.batch_size)
        batch = jnp.asarray(np.stack([data[s:s + args.seq_len + 1] for s in starts]).astype(np.int32))
        params, opt_state, loss, mx = step(params, rest, opt_state, batch)
        losses.append(loss)
        maxes.append(mx)
        if i % 10 == 0 or i == args.steps - 1:
            bar.set_postfix(loss=f"{float(loss):.3f}", max_logit=f"{float(jnp.max(mx)):.1f}")
    losses = np.asarray(jax.device_get(losses), np.float64)
    maxes = np.asarray(jax.device_get(maxes), np.float64)  # [steps, L, N]
    return {"losses": losses, "max_logits": maxes,
            "over": np.any(maxes > args.threshold, axis=(1, 2))}


def plot(runs: dict, args, path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(runs)
    fig, axes = plt.subplots(1, n + 1, figsize=(5.2 * (n + 1), 4.2))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    finite = [r["max_logits"][np.isfinite(r["max_logits"])] for r in runs.values()]
    ymax = max([float(f.max()) for f in finite if f.size] + [args.threshold]) * 1.5
    for ax, (name, r) in zip(axes, runs.items()):
        steps = np.arange(1, len(r["losses"]) + 1)
        _, L, N = r["max_logits"].shape
        for l in range(L):
            for h in range(N):
                ax.plot(steps, r["max_logits"][:, l, h], color=colors[l % len(colors)], lw=0.8,
                        alpha=0.8, label=f"layer {l}" if h == 0 else None)
        ax.axhline(args.threshold, color="k", ls="--", lw=1.2, label=f"τ = {args.threshold:g}")
        ax.set_title(f"{name}: per-head max logit")
        ax.set_xlabel("step")
        ax.set_ylabel("max attention logit")
        ax.set_yscale("log")
        ax.set_ylim(1, ymax)
        ax.legend(fontsize=8, loc="upper left")
    ax = axes[-1]
    for (name, r), c in zip(runs.items(), ["tab:red", "tab:blue"]):
        steps = np.arange(1, len(r["losses"]) + 1)
        w = max(1, min(10, len(steps) // 5))
        smooth = np.convolve(r["losses"], np.ones(w) / w, mode="valid")
        ax.plot(steps, r["losses"], color=c, lw=0.6, alpha=0.3)
        ax.plot(steps[w - 1:], smooth, color=c, lw=1.4, label=f"{name} ({w}-step mean)")
    ax.set_title("training loss (nats per byte)")
    ax.set_xlabel("step")
    ax.set_yscale("log")
    ax.legend()
    fig.suptitle(f"maxattn demo: byte-level LM on stdlib source, adam lr={args.lr:g}, "
                 f"{args.layers} layers x {args.heads} heads", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def summary(runs: dict, args) -> str:
    lines = []
    L = next(iter(runs.values()))["max_logits"].shape[1]
    head = f"{'run':<14}" + "".join(f"{'peak L' + str(l):>9}" for l in range(L)) + \
        f"{'steps>τ':>9}{'final loss':>12}"
    lines.append(f"threshold τ = {args.threshold:g}. peak L<i>: max over steps and heads of layer i's "
                 "recorded max logit (measured in each step's forward pass, before that step's clip).")
    lines.append("steps>τ: steps whose forward pass saw a head above τ (in the QK-Clip run: steps "
                 "that clipped). final loss: mean of the last 10 steps.")
    lines.append(head)
    lines.append("-" * len(head))
    for name, r in runs.items():
        peaks = r["max_logits"].max(axis=(0, 2))
        lines.append(f"{name:<14}" + "".join(f"{p:>9.1f}" for p in peaks) +
                     f"{int(r['over'].sum()):>9d}{r['losses'][-10:].mean():>12.3f}")
    return "\n".join(lines)


def parse_args(argv: Optional[list] = None):
    p = argparse.ArgumentParser(prog="maxattn-demo", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=250, help="training steps per run (default 250)")
    p.add_argument("--threshold", type=float, default=30.0, help="QK-Clip threshold τ (default 30)")
    p.add_argument("--lr", type=float, default=1e-2, help="Adam learning rate (default 1e-2, high on purpose)")
    p.add_argument("--out-dir", default="demo_out", help="output directory (default ./demo_out)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--no-clip", action="store_true", help="only the run without QK-Clip")
    g.add_argument("--clip-only", action="store_true", help="only the run with QK-Clip")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--d-model", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    args = p.parse_args(argv)
    for name in ("steps", "layers", "heads", "d_model", "seq_len", "batch_size"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive")
    if args.threshold <= 0:
        p.error("--threshold must be positive")
    if args.d_model % args.heads:
        p.error("--d-model must be a multiple of --heads")
    return args


def _missing_demo_extras() -> list:
    """The demo's optional dependencies (the ``demo`` extra) that cannot be imported."""
    import importlib
    missing = []
    for name in ("flax", "optax", "matplotlib", "tqdm"):
        try:
            importlib.import_module(name)
        except ImportError:
            missing.append(name)
    return missing


def main(argv: Optional[list] = None) -> int:
    args = parse_args(argv)
    missing = _missing_demo_extras()
    if missing:
        print(f"maxattn-demo needs {', '.join(missing)}, which {'is' if len(missing) == 1 else 'are'} "
              f"not installed: pip install \"maxattn[demo]\"", file=sys.stderr)
        return 1
    import warnings

    import jax
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", message="maxattn: falling back", category=RuntimeWarning)

    data = load_corpus()
    print(f"maxattn demo on {jax.default_backend()} ({jax.devices()[0].device_kind}); "
          f"corpus: {len(data) / 1e6:.2f} MB of Python stdlib source; "
          f"{args.layers} layers x {args.heads} heads, d={args.d_model}, seq={args.seq_len}, "
          f"batch={args.batch_size}, {args.steps} steps, lr={args.lr:g}, τ={args.threshold:g}")
    todo = [("no QK-Clip", False), ("QK-Clip", True)]
    if args.no_clip:
        todo = todo[:1]
    elif args.clip_only:
        todo = todo[1:]
    t0 = time.time()
    runs = {name: train(args, clip, data, desc=name) for name, clip in todo}
    elapsed = time.time() - t0
    os.makedirs(args.out_dir, exist_ok=True)
    png = os.path.join(args.out_dir, "maxattn_demo.png")
    plot(runs, args, png)
    npz = os.path.join(args.out_dir, "maxattn_demo.npz")
    np.savez(npz, threshold=args.threshold,
             **{f"{k.replace(' ', '_').replace('-', '')}_{f}": v for k, r in runs.items()
                for f, v in r.items()})
    print()
    print(summary(runs, args))
    print(f"\ntrained in {elapsed:.1f} s; plot written to {os.path.abspath(png)} "
          f"(data: {os.path.abspath(npz)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

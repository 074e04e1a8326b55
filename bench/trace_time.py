"""Device time of the GPU kernels run inside a block of Python, from JAX's own profiler.

`ncu_time` serialises and replays every kernel, which costs tens of milliseconds per kernel and, on
the H200 in 2026-12, crashed every training-step child it profiled. The JAX profiler records the
same kernels through CUPTI's activity API at full speed, in the benchmark's own process:

    with trace_time.kernels() as k:
        for _ in range(calls):
            out = step(params, x)
        jax.block_until_ready(out)
    k.total_ns / calls        # device ns per step: the sum of the kernels' durations

`interleaved` times several variants in interleaved samples, by that pattern or by the wall clock: it
is the sampling loop of bench/gpu.py, bench/gpu_kernels.py --trace and bench/train_step.py.

Each kernel's duration is its own start-to-end time on the GPU (launch gaps excluded, as with ncu);
memsets and copies are not kernels and are not counted. Kernels that overlap on different streams
would each count in full (XLA runs a step on one compute stream).
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import os
import tempfile
import time
from collections.abc import Callable, Iterator

import jax
from jax.profiler import ProfileData

# Events of the GPU planes' stream lines that are not kernels.
_NOT_KERNELS = ("Memcpy", "Memset", "memcpy", "memset")


@dataclasses.dataclass
class Kernels:
    """The kernels of one traced block: (name, ns) in launch order, filled when the block exits."""

    kernels: list[tuple[str, float]] = dataclasses.field(default_factory=list)
    layout: str = ""  # the trace's planes and lines, when no kernel was found (to see why)

    @property
    def total_ns(self) -> float:
        return sum(ns for _, ns in self.kernels)


def parse(data: ProfileData) -> Kernels:
    """The kernels of the GPU planes of a trace: events of the stream lines ("Stream #..."),
    except copies and memsets. With none, `layout` lists the trace's planes and lines."""
    events = []
    for plane in data.planes:
        if not plane.name.startswith("/device:GPU"):
            continue
        for line in plane.lines:
            if not line.name.startswith("Stream"):
                continue
            for ev in line.events:
                if ev.duration_ns > 0 and not ev.name.startswith(_NOT_KERNELS):
                    events.append((ev.start_ns, ev.name, ev.duration_ns))
    found = Kernels(kernels=[(name, ns) for _, name, ns in sorted(events)])
    if not found.kernels:
        found.layout = "; ".join(
            f"{plane.name}: " + ", ".join(f"{ln.name} ({len(list(ln.events))})" for ln in plane.lines)
            for plane in data.planes)
    return found


@contextlib.contextmanager
def kernels() -> Iterator[Kernels]:
    """Traces the block with jax.profiler; on exit the yielded record holds its GPU kernels."""
    result = Kernels()
    with tempfile.TemporaryDirectory(prefix="trace_time_") as log_dir:
        with jax.profiler.trace(log_dir):
            yield result
        files = glob.glob(os.path.join(log_dir, "**", "*.xplane.pb"), recursive=True)
        if not files:
            result.layout = f"no .xplane.pb under {log_dir}"
            return
        parsed = parse(ProfileData.from_file(max(files, key=os.path.getmtime)))
        result.kernels, result.layout = parsed.kernels, parsed.layout


@dataclasses.dataclass
class Sample:
    """One timed block of a variant: `calls` calls, then one block_until_ready."""

    seconds: float  # per call: the block's kernels' device time when traced, else the wall clock
    kernels: list[tuple[str, float]]  # (name, ns) of the block's GPU kernels; empty when not traced


def interleaved(variants: dict[str, Callable[[], object]], calls: int, reps: int, *, warmup: int = 0,
                trace: bool = True, groups: list[list[str]] | None = None,
                settle_s: float = 0.0) -> tuple[dict[str, list[Sample]], dict[str, str]]:
    """Times `warmup + reps` blocks of `calls` calls of each variant (a callable that runs one call
    and returns its result), the variants interleaved; the first `warmup` repetitions are run and
    dropped. The order changes every repetition so that no variant always runs right after the same
    one (on a power-capped GPU the clock follows the load that came before): the `groups` (lists of
    names; default one group of all, in the dict's order) rotate by one, and each group's own order
    is reversed on odd repetitions. `settle_s`: each block is preceded by that many seconds of
    untimed calls of the same variant, so that the clock has adapted to it.

    With `trace` a block's time is the device time of its GPU kernels (`kernels`); a variant whose
    trace holds none is dropped from then on, with the reason. Without it, the wall clock from the
    first call to block_until_ready. Returns each kept variant's `reps` samples, and the reasons.
    """
    groups = [[n for n in g if n in variants] for g in (groups or [list(variants)])]
    groups = [g for g in groups if g]
    samples: dict[str, list[Sample]] = {n: [] for g in groups for n in g}
    errors: dict[str, str] = {}
    for r in range(warmup + reps):
        k = r % len(groups) if groups else 0
        for g in groups[k:] + groups[:k]:
            for name in g if r % 2 == 0 else g[::-1]:
                if name in errors:
                    continue
                call = variants[name]
                t_settle = time.perf_counter() + settle_s
                while time.perf_counter() < t_settle:
                    jax.block_until_ready(call())
                with kernels() if trace else contextlib.nullcontext() as traced:
                    t0 = time.perf_counter()
                    out = None
                    for _ in range(calls):
                        out = call()
                    jax.block_until_ready(out)
                    seconds = (time.perf_counter() - t0) / calls
                if traced is not None:
                    if not traced.kernels:
                        errors[name] = f"no GPU kernels in the profile; its planes: {traced.layout}"
                        del samples[name]
                        continue
                    seconds = traced.total_ns / calls / 1e9
                if r >= warmup:
                    samples[name].append(Sample(seconds, list(traced.kernels) if traced is not None else []))
    return samples, errors

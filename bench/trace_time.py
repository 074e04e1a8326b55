"""Device time of the GPU kernels run inside a block of Python, from JAX's own profiler.

`ncu_time` serialises and replays every kernel, which costs tens of milliseconds per kernel and, on
the H200 in 2026-12, crashed every training-step child it profiled. The JAX profiler records the
same kernels through CUPTI's activity API at full speed, in the benchmark's own process:

    with trace_time.kernels() as k:
        for _ in range(calls):
            out = step(params, x)
        jax.block_until_ready(out)
    k.total_ns / calls        # device ns per step: the sum of the kernels' durations

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
from typing import Iterator

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

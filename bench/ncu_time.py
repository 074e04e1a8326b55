"""Device time of a child process's profiled range, from Nsight Compute (shared by the benchmarks).

Wall-clock samples on the shared GPU machines spread by 5-50%; the device time of the kernels is
stable to a fraction of a percent. `kernel_times` runs a command under

    ncu --profile-from-start off --clock-control none --metrics gpu__time_duration.sum

and returns each kernel launched inside the child's `profiled()` range with its device time. ncu
serialises the kernels, so their sum excludes launch gaps; memsets and copies are not kernels and
are not counted. The child runs with XLA's command buffers (CUDA graphs) off.
"""

from __future__ import annotations

import contextlib
import csv
import io
import os
import subprocess


def kernel_times(argv: list[str], timeout: float = 600, live_stderr: bool = False,
                 xla_flags: str = "") -> list[tuple[str, float]] | str:
    """[(kernel name, ns)] of every kernel in the profiled range of `argv`, or the error text.
    live_stderr: the child's stderr goes straight to ours (its progress, as it happens) instead of
    into the error text. xla_flags: more XLA flags for the child."""
    cmd = ["ncu", "--profile-from-start", "off", "--clock-control", "none", "--metrics", "gpu__time_duration.sum",
           "--csv", "--print-units", "base", *argv]
    # XLA replays longer kernel sequences (a training step) as CUDA graphs ("command buffers"); ncu
    # then profiles graph nodes, slowly if at all -- two train_step.py runs printed nothing for
    # minutes. Plain launches give the same kernels and the same device times.
    flags = " ".join(f for f in (os.environ.get("XLA_FLAGS", ""), "--xla_gpu_enable_command_buffer=", xla_flags) if f)
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false", "XLA_FLAGS": flags}
    try:
        res = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=None if live_stderr else subprocess.PIPE, text=True,
                             timeout=timeout, env=env)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{type(e).__name__}: {e}"
    kernels = parse_csv(res.stdout)
    return kernels if kernels else (res.stderr or res.stdout)[-2000:]


def csv_records(text: str) -> list[dict[str, str]]:
    """The records of ncu's --csv output: its quoted lines, keyed by the header among them (a
    metrics page's, with "Metric Name", or the source page's, with "Address": that page starts with a
    ("Kernel Name", name) line before it). Fields past the header's are dropped (the source page can
    carry more than it names)."""
    lines = [line for line in text.splitlines() if line.startswith('"')]
    table = list(csv.reader(io.StringIO("\n".join(lines))))
    start = next((i for i, row in enumerate(table) if "Address" in row or "Metric Name" in row), 0)
    if start >= len(table):
        return []
    return [dict(zip(table[start], row)) for row in table[start + 1:]]


def parse_csv(text: str) -> list[tuple[str, float]]:
    """The (kernel name, gpu__time_duration.sum in ns) records of ncu's --csv output."""
    return [(rec["Kernel Name"], float(rec["Metric Value"].replace(",", "")))
            for rec in csv_records(text) if rec.get("Metric Name") == "gpu__time_duration.sum"]


@contextlib.contextmanager
def profiled():
    """The range ncu profiles (cudaProfilerStart/Stop through CuPy); the caller synchronises inside it."""
    import cupy

    cupy.cuda.runtime.profilerStart()
    try:
        yield
    finally:
        cupy.cuda.runtime.profilerStop()

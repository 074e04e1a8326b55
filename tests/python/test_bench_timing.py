"""The benchmarks' sampling loop (bench/trace_time.py: interleaved), on the CPU.

bench/gpu.py, bench/gpu_kernels.py --trace and bench/train_step.py time their variants through it,
so its order and bookkeeping decide what every GPU table compares."""

from __future__ import annotations

import pathlib
import sys

import jax.numpy as jnp
import pytest

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "bench"))
import trace_time


def _recording(log: list[str], names: list[str]) -> dict:
    def make(name):
        def call():
            log.append(name)
            return jnp.zeros(())
        return call
    return {n: make(n) for n in names}


@pytest.mark.parametrize("warmup", [0, 2])
def test_interleaved_order_and_samples(warmup):
    log: list[str] = []
    calls, reps = 3, 4
    samples, errors = trace_time.interleaved(_recording(log, ["a", "b", "c"]), calls, reps, warmup=warmup,
                                             trace=False)
    assert errors == {}
    # One block = `calls` calls of one variant; the whole order reverses on odd repetitions.
    blocks = log[::calls]
    assert all(log[i:i + calls] == [log[i]] * calls for i in range(0, len(log), calls))
    expected = []
    for r in range(warmup + reps):
        expected += ["a", "b", "c"] if r % 2 == 0 else ["c", "b", "a"]
    assert blocks == expected
    assert set(samples) == {"a", "b", "c"}
    for runs in samples.values():
        assert len(runs) == reps  # the warm-up repetitions are dropped
        assert all(run.seconds > 0 and run.kernels == [] for run in runs)


def test_interleaved_groups_rotate_and_settle():
    log: list[str] = []
    calls = 2
    variants = _recording(log, ["x", "y", "z", "w"])
    groups = [["x", "y"], ["z"], ["w", "missing"]]  # a name without a variant is ignored
    samples, errors = trace_time.interleaved(variants, calls, 3, trace=False, groups=groups)
    assert errors == {} and {n: len(s) for n, s in samples.items()} == {"x": 3, "y": 3, "z": 3, "w": 3}
    blocks = log[::calls]
    assert blocks == ["x", "y", "z", "w",     # r = 0: groups in order, each forwards
                      "z", "w", "y", "x",     # r = 1: rotated by one, each group reversed
                      "w", "x", "y", "z"]     # r = 2: rotated by two
    # settle_s: untimed calls before each block, at least one per block.
    log.clear()
    trace_time.interleaved({"x": variants["x"]}, calls, 2, trace=False, settle_s=1e-4)
    assert len(log) >= 2 * (calls + 1)


def test_interleaved_trace_without_gpu_kernels():
    """On the CPU the profile holds no GPU plane: every variant is dropped after its first block,
    with the reason, and none keeps a sample."""
    log: list[str] = []
    samples, errors = trace_time.interleaved(_recording(log, ["a", "b"]), 2, 3, trace=True)
    assert samples == {}
    assert set(errors) == {"a", "b"}
    assert all("no GPU kernels" in why for why in errors.values())
    assert log == ["a", "a", "b", "b"]  # one block each, then nothing more


def test_gpu_benchmark_smoke_runs_on_the_cpu(tmp_path):
    """bench/gpu.py --smoke (tiny shapes, implementation="cpu"): every variant of a row is timed
    through the sampling loop above and reported."""
    import json
    import subprocess

    root = pathlib.Path(__file__).resolve().parents[2]
    out = tmp_path / "smoke.json"
    res = subprocess.run([sys.executable, str(root / "bench" / "gpu.py"), "--smoke", "--json", str(out)],
                         check=False, capture_output=True, text=True, timeout=600, cwd=root)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "max_logit overhead" in res.stdout
    report = json.loads(out.read_text())
    assert report["failures"] == [] and len(report["results"]) == 2
    for row in report["results"]:
        assert row["errors"] == {}
        for name in ("fwd", "fwd+max", "fwd+lse", "fwd+lse+max", "fwd+bwd", "jax fwd", "jax fwd+bwd", "jax+max"):
            assert row["ms"][name] > 0, name

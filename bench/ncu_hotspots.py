#!/usr/bin/env python3
"""Where a kernel's warps wait, instruction by instruction, from Nsight Compute's PC sampling.

On the device machine:

    bench/ncu_hotspots.py --kernel BwdKernel --out $OUT/bwd -- build/prebuilt/X/sm90_bwd_harness --perf-only --shape 0
    bench/ncu_hotspots.py --report $OUT/bwd.ncu-rep          # read an existing report again

Profiles one launch of the first kernel whose name matches --kernel (after --skip launches of it)
with `--set full` and source counters, then prints: the kernel's duration and throughput figures,
the stall reasons summed over the kernel, and the --top SASS instructions by warp-stall samples,
each with its share and its two largest stall reasons. The report stays next to the text
(<out>.ncu-rep, <out>.txt) for the GUI.
"""
from __future__ import annotations

import argparse
import gzip
import subprocess
import sys

from ncu_time import csv_records


def run(cmd: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, capture_output=True, text=True)


def number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except (AttributeError, ValueError):
        return 0.0


def source_page(report: str) -> tuple[list[dict[str, str]], str]:
    """The SASS rows of the report's source page, and the raw CSV."""
    for extra in (["--print-source", "sass"], []):
        res = run(["ncu", "-i", report, "--page", "source", "--csv", *extra])
        rows = csv_records(res.stdout)
        if rows:
            return rows, res.stdout
    sys.exit(f"no source page in {report}: {res.stderr[-1000:]}")


def details(report: str) -> list[str]:
    wanted = ("Duration", "Compute (SM) Throughput", "Memory Throughput", "L2 Cache Throughput",
              "DRAM Throughput", "Registers Per Thread", "Issued Warp Per Scheduler", "Achieved Occupancy",
              "Dynamic Shared Memory Per Block", "Executed Ipc Active", "Issue Slots Busy", "SM Busy",
              "L2 Hit Rate", "Elapsed Cycles")
    try:
        res = run(["ncu", "-i", report, "--page", "details", "--csv"])
    except OSError as e:
        return [f"  (no details: {e})"]
    out = []
    for rec in csv_records(res.stdout):
        if rec.get("Metric Name") in wanted:
            out.append(f"  {rec['Metric Name']}: {rec.get('Metric Value')} {rec.get('Metric Unit', '')}")
    return out


def summarize(rows: list[dict[str, str]], report: str, top: int) -> str:
    cols = list(rows[0].keys())
    total_col = next((c for c in cols if "Sampling (All" in c), None)
    if total_col is None:
        return "columns: " + ", ".join(cols)
    reasons = [c for c in cols if c.lower().startswith("stall_") and "Not Issued" not in c]
    if not reasons:  # older ncu names the per-reason columns after the reason only
        reasons = [c for c in cols if "stall" in c.lower() and c != total_col and "Not-issued" not in c]
    total = sum(number(r[total_col]) for r in rows) or 1.0
    lines = [f"report {report}", *details(report), f"stall samples: {total:.0f}", "by reason:"]
    by_reason = sorted(((sum(number(r[c]) for r in rows), c) for c in reasons), reverse=True)
    lines += [f"  {v / total:6.1%}  {c}" for v, c in by_reason if v > 0][:16]
    addr_col = next((c for c in cols if c.lower() in ("address", "# address")), cols[0])
    src_col = next((c for c in cols if c.lower() == "source"), cols[1])
    lines.append(f"top {top} instructions:")
    for r in sorted(rows, key=lambda r: -number(r[total_col]))[:top]:
        mine = sorted(((number(r[c]), c) for c in reasons), reverse=True)[:2]
        why = ", ".join(f"{c.replace('stall_', '')} {v / total:.1%}" for v, c in mine if v > 0)
        lines.append(f"  {number(r[total_col]) / total:6.2%}  {r[addr_col]:>6}  {r[src_col].strip()[:90]}  [{why}]")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kernel", help="regex of the kernel name to profile")
    p.add_argument("--skip", type=int, default=2, help="launches of that kernel to skip (warm-up)")
    p.add_argument("--name-base", default="demangled", help="what --kernel matches (ncu --kernel-name-base)")
    p.add_argument("--out", help="report path without extension")
    p.add_argument("--report", help="read this existing .ncu-rep instead of profiling")
    p.add_argument("--csv", help="summarize a saved source page (<out>.source.csv.gz) instead")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("command", nargs=argparse.REMAINDER)
    opts = p.parse_args()
    if opts.csv:
        with gzip.open(opts.csv, "rt") as f:
            print(summarize(csv_records(f.read()), opts.csv, opts.top))
        return
    report = opts.report
    if report is None:
        if not (opts.kernel and opts.out and opts.command):
            p.error("--kernel, --out and a command (after --) are needed to profile")
        command = opts.command[1:] if opts.command[0] == "--" else opts.command
        res = run(["ncu", "--set", "full", "--import-source", "yes", "--kernel-name-base", opts.name_base, "-k", f"regex:{opts.kernel}",
                   "--launch-skip", str(opts.skip), "--launch-count", "1", "-f", "-o", opts.out, *command])
        if res.returncode != 0:
            sys.exit(f"ncu failed ({res.returncode}):\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}")
        report = opts.out + ".ncu-rep"
    rows, raw = source_page(report)
    if opts.out:  # the raw page, for a second look without the report
        with gzip.open(opts.out + ".source.csv.gz", "wt") as f:
            f.write(raw)
    try:
        text = summarize(rows, report, opts.top)
    except Exception as e:  # noqa: BLE001 -- an unexpected page layout must not lose the profile
        text = f"could not summarize ({type(e).__name__}: {e}); columns: {list(rows[0])}\n" + raw[:3000]
    print(text)
    if opts.out:
        with open(opts.out + ".txt", "w") as f:
            f.write(text + "\n")


if __name__ == "__main__":
    main()

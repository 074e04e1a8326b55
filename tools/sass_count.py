#!/usr/bin/env python3
"""Static SASS of two builds, kernel by kernel: instruction totals, spill instructions and the
opcodes whose counts changed. For a kernel change before (or without) a GPU run: which
instructions it adds or removes, and whether it spills.

    tools/sass_count.py OLD NEW [--kernel REGEX] [--all]

OLD and NEW are anything cuobjdump reads: an object file (nvcc -c), a harness binary
(build/prebuilt/*/sm90_bwd_harness) or a shared library. Kernels are matched by their mangled
names (--kernel filters them, default: the sm90 main kernels); --all also lists kernels whose
counts did not change. Counts are static (each instruction once, whatever the loop trip counts).

cuobjdump comes with the CUDA toolkit; where the toolkit lacks it, the PyPI wheel
nvidia-cuda-cuobjdump carries it (bin/cuobjdump): pass its folder in CUOBJDUMP_DIR or put it
on PATH.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import shutil
import subprocess
import sys

_FUNCTION = re.compile(r"^\s*Function : (\S+)")
# "/*0a20*/  @!P0 R2UR UR57, R18 ;": the predicate is optional, the opcode's first part counts.
_INSTRUCTION = re.compile(r"^\s*/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")


def _cuobjdump() -> str:
    # shutil.which searches PATH when `path` is None.
    for folder in (os.environ.get("CUOBJDUMP_DIR") or None, None, "/usr/local/cuda/bin"):
        if found := shutil.which("cuobjdump", path=folder):
            return found
    sys.exit("cuobjdump not found: install the toolkit's, or the nvidia-cuda-cuobjdump wheel and set CUOBJDUMP_DIR")


def opcode_counts(path: str) -> dict[str, collections.Counter]:
    """Per kernel (mangled name), how many times each opcode occurs in its SASS."""
    sass = subprocess.run([_cuobjdump(), "-sass", path], capture_output=True, text=True, check=True).stdout
    kernels: dict[str, collections.Counter] = {}
    current = None
    for line in sass.splitlines():
        if m := _FUNCTION.match(line):
            current = kernels.setdefault(m.group(1), collections.Counter())
        elif current is not None and (m := _INSTRUCTION.match(line)):
            current[m.group(1)] += 1
    return kernels


def _spills(counts: collections.Counter) -> int:
    return counts["STL"] + counts["LDL"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old")
    parser.add_argument("new")
    parser.add_argument("--kernel", default=r"(Fwd|Bwd)Kernel", help="regex on the mangled kernel names")
    parser.add_argument("--all", action="store_true", help="also list kernels whose counts did not change")
    args = parser.parse_args()
    old, new = opcode_counts(args.old), opcode_counts(args.new)
    pattern = re.compile(args.kernel)
    for name in sorted(set(old) | set(new)):
        if not pattern.search(name):
            continue
        a, b = old.get(name), new.get(name)
        if a is None or b is None:
            print(f"{name}: only in {'new' if a is None else 'old'}")
            continue
        delta = {op: b[op] - a[op] for op in set(a) | set(b) if b[op] != a[op]}
        if not delta and not args.all:
            continue
        print(f"{name}\n  {sum(a.values())} -> {sum(b.values())} instructions, "
              f"spill stores+loads {_spills(a)} -> {_spills(b)}")
        if delta:
            print("  " + " ".join(f"{op}{d:+d}" for d, op in sorted((d, op) for op, d in delta.items())))


if __name__ == "__main__":
    main()

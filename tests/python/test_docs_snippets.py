"""Runs every ```python block of README.md and docs/*.md, so that no documented example can rot.

Each block runs on its own, in a fresh namespace, in this process (JAX's caches make that fast).
A marker on the line before the opening fence changes that:

* ``<!-- snippet: gpu -->``: needs a GPU; skipped where JAX has none.
* ``<!-- snippet: devices=8 -->``: runs in a subprocess with
  ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` (8 simulated CPU devices).
* ``<!-- snippet: continue -->``: runs in the namespace left by the previous block of the same file.

Any other marker is an error, so a typo cannot silently skip a block. Blocks fenced as anything
but ``python`` (``bash``, ``text``) are not run.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
from dataclasses import dataclass, field

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
DOC_FILES = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))

_FENCE = re.compile(r"^```([A-Za-z0-9_+-]*)\s*$")
_MARKER = re.compile(r"^<!--\s*snippet:\s*(.*?)\s*-->\s*$")
_KNOWN = {"gpu", "devices=8", "continue"}


@dataclass
class Snippet:
    path: pathlib.Path
    line: int  # 1-based line of the opening fence
    code: str
    markers: set = field(default_factory=set)

    @property
    def id(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"


def extract(path: pathlib.Path) -> list[Snippet]:
    """The ```python blocks of a Markdown file, with their markers."""
    lines = path.read_text(encoding="utf-8").splitlines()
    out, i = [], 0
    while i < len(lines):
        m = _FENCE.match(lines[i])
        if not m:
            i += 1
            continue
        lang, start = m.group(1), i
        j = i + 1
        while j < len(lines) and lines[j].rstrip() != "```":
            j += 1
        if j == len(lines):
            raise ValueError(f"{path}:{start + 1}: unclosed code fence")
        if lang == "python":
            markers: set = set()
            k = start - 1
            while k >= 0 and not lines[k].strip():
                k -= 1
            mk = _MARKER.match(lines[k]) if k >= 0 else None
            if mk:
                markers = {w for w in re.split(r"[\s,]+", mk.group(1)) if w}
            out.append(Snippet(path, start + 1, "\n".join(lines[start + 1:j]) + "\n", markers))
        i = j + 1
    return out


SNIPPETS = [s for p in DOC_FILES for s in extract(p)]
_NAMESPACES: dict = {}


def _has_gpu() -> bool:
    import jax
    try:
        return bool(jax.devices("gpu"))
    except RuntimeError:
        return False


def test_snippets_are_found_and_markers_known():
    files = {s.path.name for s in SNIPPETS}
    assert {"README.md", "contract.md", "migrating.md"} <= files, files
    for s in SNIPPETS:
        unknown = s.markers - _KNOWN
        assert not unknown, f"{s.id}: unknown snippet marker(s) {sorted(unknown)}; known: {sorted(_KNOWN)}"


def test_extract_reads_markers_and_skips_other_languages(tmp_path):
    md = tmp_path / "x.md"
    md.write_text("# t\n\n```bash\necho hi\n```\n\n<!-- snippet: devices=8 -->\n```python\nx = 1\n```\n"
                  "\n```python\ny = 2\n```\n")
    got = extract(md)
    assert [(s.line, s.code, s.markers) for s in got] == [(8, "x = 1\n", {"devices=8"}),
                                                            (12, "y = 2\n", set())]


@pytest.mark.parametrize("snippet", SNIPPETS, ids=[s.id for s in SNIPPETS])
def test_snippet_runs(snippet: Snippet):
    if "gpu" in snippet.markers and not _has_gpu():
        pytest.skip("GPU-only snippet; JAX has no GPU here")
    if "devices=8" in snippet.markers:
        env = dict(os.environ)
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8").strip()
        env.setdefault("JAX_PLATFORMS", "cpu")
        proc = subprocess.run([sys.executable, "-c", snippet.code], env=env, cwd=str(ROOT),
                              capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"{snippet.id} failed:\n{proc.stdout}\n{proc.stderr[-4000:]}"
        return
    key = snippet.path
    ns = _NAMESPACES.get(key, {}) if "continue" in snippet.markers else {}
    if "continue" in snippet.markers and not ns:
        pytest.fail(f"{snippet.id}: 'continue' but the previous block of this file did not run here")
    ns.setdefault("__name__", "__snippet__")
    exec(compile(snippet.code, snippet.id, "exec"), ns)  # noqa: S102 - running our own docs
    _NAMESPACES[key] = ns


def test_docs_stand_alone():
    """README and docs link only to files inside the repository, and those files exist."""
    link = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")
    for path in DOC_FILES:
        text = path.read_text(encoding="utf-8")
        assert "../shared" not in text, f"{path.name} refers to ../shared"
        for target in link.findall(text):
            if re.match(r"^[a-z]+://", target) or target.startswith("mailto:"):
                continue
            resolved = (path.parent / target).resolve()
            assert resolved.is_relative_to(ROOT), f"{path.name}: link {target} leaves the repository"
            assert resolved.exists(), f"{path.name}: link {target} points to a missing file"

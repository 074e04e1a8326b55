"""MkDocs hooks (mkdocs.yml: hooks).

* Stages a copy of python/maxattn under build/docs-src with an empty ``__init__.py`` in every
  package folder that lacks one (``maxattn/_src`` is a namespace package, and griffe's static
  analysis does not enter namespace sub-packages of a regular package). mkdocstrings reads the
  API from that copy, without importing maxattn or needing its compiled modules.
* Lists docs/architecture.md in the navigation once that page exists (listing a missing page, or
  leaving an existing one out, fails the strict build).
* Fills docs/versions.md's features marker with README.md's feature table (between its
  ``features:start`` and ``features:end`` comments), so that the table has one owner.
"""

import logging
import os
import shutil

from mkdocs.plugins import event_priority

# Known docstring-format warnings in files this hook's owners do not edit, downgraded so that
# every other warning still fails the strict build. Remove an entry once its docstring is fixed.
_KNOWN_DOCSTRING_WARNINGS = (
    # "Raises:" in maxattn/_src/api.py reads "ValueError / TypeError at trace time ..." instead of
    # one "ExceptionType: description" item per exception.
    ("_src/api.py", "Failed to get 'exception: description' pair"),
)


class _DowngradeKnown(logging.Filter):
    def filter(self, record):
        msg = record.getMessage()
        if record.levelno == logging.WARNING and any(f in msg and w in msg for f, w in _KNOWN_DOCSTRING_WARNINGS):
            record.levelno, record.levelname = logging.INFO, "INFO"
        return True


logging.getLogger("mkdocs.plugins.griffe").addFilter(_DowngradeKnown())


@event_priority(100)  # before mkdocstrings sets up its handler
def on_config(config):
    root = os.path.dirname(config["config_file_path"])
    src = os.path.join(root, "python", "maxattn")
    dst = os.path.join(root, "build", "docs-src", "maxattn")
    shutil.rmtree(dst, ignore_errors=True)
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyc"))
    for folder, _, files in os.walk(dst):
        if any(f.endswith(".py") for f in files) and "__init__.py" not in files:
            open(os.path.join(folder, "__init__.py"), "w").close()

    page = "architecture.md"
    if os.path.isfile(os.path.join(config["docs_dir"], page)):
        listed = [next(iter(e.values())) if isinstance(e, dict) else e for e in config["nav"]]
        if page not in listed:
            config["nav"].insert(2, {"Architecture": page})
    return config


_FEATURES_MARKER = "<!-- features: the table of README.md, inserted by docs/_hooks/hooks.py -->"


def _readme_features(root):
    with open(os.path.join(root, "README.md"), encoding="utf-8") as f:
        text = f.read()
    start = text.index("<!-- features:start")
    start = text.index("\n", start) + 1
    return text[start:text.index("<!-- features:end -->")].rstrip("\n")


def on_page_markdown(markdown, page, config, files):
    if page.file.src_path != "versions.md":
        return markdown
    if _FEATURES_MARKER not in markdown:
        raise ValueError(f"docs/versions.md lost its features marker: {_FEATURES_MARKER}")
    root = os.path.dirname(config["config_file_path"])
    return markdown.replace(_FEATURES_MARKER, _readme_features(root))

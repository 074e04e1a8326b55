"""MkDocs hooks (mkdocs.yml: hooks).

* Stages a copy of python/maxattn under build/docs-src with an empty ``__init__.py`` in every
  package folder that lacks one (``maxattn/_src`` is a namespace package, and griffe's static
  analysis does not enter namespace sub-packages of a regular package). mkdocstrings reads the
  API from that copy, without importing maxattn or needing its compiled modules.
* Lists docs/architecture.md in the navigation once that page exists (listing a missing page, or
  leaving an existing one out, fails the strict build).
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

#!/usr/bin/env bash
# The README's demo command: installs maxattn[demo] into ./.venv and trains the
# QK-Clip demo (pass demo options through, e.g. --steps 100).
set -euo pipefail
cd "$(dirname "$0")/.."
tools/setup_env.sh demo
exec .venv/bin/python -m maxattn.demo "$@"

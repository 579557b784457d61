#!/usr/bin/env bash
# Creates .venv with oomguard and what it needs; idempotent and quick when nothing changed.
# torch: a user's existing torch is kept (the venv sees system site-packages then); otherwise
# the CUDA build where nvidia-smi finds a GPU, else the pinned CPU build (no multi-GB download).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
EXTRAS=${1:-}
stamp=".venv/.oomguard-installed${EXTRAS:+-$EXTRAS}"
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ]; then exit 0; fi
# pip warns about every local index folder this machine's config names but lacks; that is noise.
pip_install() { .venv/bin/pip install -q "$@" 2>&1 | { grep -v "^WARNING: Location 'file:" || true; }; }
if [ ! -x .venv/bin/python ]; then
  if "$PY" -c "import torch" 2>/dev/null; then
    echo "bootstrap: using the torch already installed for $PY" >&2
    "$PY" -m venv --system-site-packages .venv
  else
    "$PY" -m venv .venv
  fi
fi
if ! .venv/bin/python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    pip_install torch
  else
    pip_install torch==2.13.0
  fi
fi
pip_install -e ".[worker${EXTRAS:+,$EXTRAS}]"
touch "$stamp"

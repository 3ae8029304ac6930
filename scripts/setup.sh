#!/usr/bin/env bash
# Creates .venv with pinned dependencies (torch 2.13.0 CPU wheel from the local disk first, so nothing pulls a CUDA build),
# installs the project in editable mode and generates the gRPC code. Idempotent: a second run is fast.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3.11 -m venv .venv 2>/dev/null || python3 -m venv .venv
fi
stamp=.venv/.installed-$(sha1sum pyproject.toml | cut -c1-12)
if [ ! -f "$stamp" ]; then
  .venv/bin/pip install -q --upgrade pip
  .venv/bin/pip install -q torch==2.13.0
  .venv/bin/pip install -q -e ".[dev,train]"
  touch "$stamp"
fi
.venv/bin/python proto/codegen.py

#!/usr/bin/env bash
# Creates .venv with pinned dependencies (torch 2.13.0 CPU wheel from the local disk first, so nothing pulls a CUDA
# build) and installs the server (editable, with dev and train extras) and the client SDK (./client). The gRPC code is
# generated from proto/ and committed (`python proto/codegen.py` regenerates it). Idempotent: a second run is fast.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3.11 -m venv .venv 2>/dev/null || python3 -m venv .venv
fi
stamp=.venv/.installed-$(cat pyproject.toml client/pyproject.toml | sha1sum | cut -c1-12)
if [ ! -f "$stamp" ]; then
  .venv/bin/pip install -q --upgrade pip
  .venv/bin/pip install -q torch==2.13.0
  .venv/bin/pip install -q -e ./client -e ".[dev,train]"
  rm -f .venv/.installed-*
  touch "$stamp"
fi

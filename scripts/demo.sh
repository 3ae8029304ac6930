#!/usr/bin/env bash
# Set up (idempotent) and run the main job: the decoupled draft/target service on the embedded tiny Qwen3 pair,
# through Ray Serve and gRPC, streaming a medical answer and printing its speculative-decoding statistics.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
exec .venv/bin/evospec demo "$@"

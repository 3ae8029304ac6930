#!/usr/bin/env bash
# The same load, driven three ways against one running service (docs/loadtest.md):
#   guidellm (pinned, in its own venv) on the OpenAI-compatible HTTP front,
#   evospec loadtest --api openai (the same HTTP front), evospec loadtest --api grpc (our SDK on the gRPC front),
# then one table (evospec loadtest-compare). Start the service first, e.g.
#   .venv/bin/evospec serve --config orchestration/configs/cpu-qwen2.5-coder.yaml
# Settings (environment): HTTP, GRPC, N requests, LEN output tokens, C concurrent streams, TOK (a local tokenizer
# folder for guidellm: the target model's), OUT, GUIDELLM_VENV.
set -euo pipefail
cd "$(dirname "$0")/.."
HTTP=${HTTP:-http://127.0.0.1:8000}
GRPC=${GRPC:-127.0.0.1:9000}
N=${N:-16}
LEN=${LEN:-64}
C=${C:-4}
TOK=${TOK:-${EVOSPEC_CACHE:-$HOME/.cache/evospec}/models/qwen2.5-coder/target}
OUT=${OUT:-results/loadtest_tools}
GUIDELLM_VENV=${GUIDELLM_VENV:-.venv-guidellm}

if [ ! -x "$GUIDELLM_VENV/bin/guidellm" ]; then  # its own venv: guidellm pins its own torch/transformers versions
  python3.11 -m venv "$GUIDELLM_VENV"
  "$GUIDELLM_VENV/bin/pip" install -q torch==2.13.0 guidellm==0.8.1  # torch first from the CPU wheel (1.5 GB, not 6)
fi
mkdir -p "$OUT"
.venv/bin/evospec loadtest --num-prompts "$N" --output-len "$LEN" --write-dataset "$OUT/requests.jsonl"

# guidellm sends no temperature (OpenAI's default, 1.0) and ignore_eos: ours below does the same.
HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_DATASETS_OFFLINE=1 "$GUIDELLM_VENV/bin/guidellm" run \
  --backend "kind=openai_http,target=$HTTP" \
  --tokenizer "kind=hf_auto,model=$TOK" \
  --data "kind=json_file,path=$OUT/requests.jsonl" \
  --profile "kind=concurrent,streams=$C" \
  --constraint "kind=max_requests,count=$N" \
  --output "kind=json,path=$OUT/guidellm/benchmarks.json" --disable-progress
for api in openai grpc; do
  server=$([ "$api" = openai ] && echo "$HTTP" || echo "$GRPC")
  .venv/bin/evospec loadtest --api "$api" --server "$server" --num-prompts "$N" --output-len "$LEN" \
    --max-concurrency "$C" --temperature 1 --ignore-eos --out "$OUT/ours-$api"
done
.venv/bin/evospec loadtest-compare "$OUT"

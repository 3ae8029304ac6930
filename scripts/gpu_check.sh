#!/usr/bin/env bash
# What the project does on a GPU, in one short run (bench/gpu_check.py says what it measures). Results: $OUT, else
# results/gpu/ (gpu_check.json, gpu_check.md).
#
#   scripts/gpu_check.sh --cpu               the same steps on tiny models on the CPU, with the project's venv (CI)
#   scripts/gpu_check.sh --prepare           here, before borrowing a GPU machine: what it lacks, into .gpu/
#   scripts/gpu_check.sh                     on the GPU machine (its python3 has CUDA torch; nothing is downloaded)
#
# The GPU machine's image has torch, transformers, safetensors and tokenizers but not pydantic, and other versions
# of grpcio and protobuf than ours; ../shared does not travel there. --prepare fetches our wheels (Python 3.12,
# manylinux) into .gpu/wheels/ and copies the prompt data the decoupled step reads into .gpu/data/ (.gpu/ is
# git-ignored: carry it, ~14 MB); the GPU run installs the wheels under /tmp/site and reads the data from there.
# The project itself is put on the path by links, as the editable install does here (evospec.bench -> bench/, ...),
# so nothing needs building there.
set -euo pipefail
cd "$(dirname "$0")/.."

WHEELS=(pydantic==2.14.3 pydantic-core==2.50.4 annotated-types==0.8.0 typing-inspection==0.4.5 protobuf==7.36.2
        grpcio==1.85.1 grpcio-health-checking==1.85.1 grpcio-reflection==1.85.1 pyyaml==6.0.3 typing-extensions==4.16.0)

case "${1:-}" in
  --prepare)
    mkdir -p .gpu/wheels .gpu/data
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
      -d .gpu/wheels "${WHEELS[@]}"
    data=$(.venv/bin/python -c "from evospec.datasets import shared_data_dir; print(shared_data_dir())" 2>/dev/null \
           || echo ../shared/data)
    cp -r "$data/pubmedqa" .gpu/data/
    du -sh .gpu
    exit 0 ;;
  --cpu)
    [ -x .venv/bin/python ] || ./scripts/setup.sh
    exec .venv/bin/python -m evospec.bench.gpu_check "$@" ;;
esac

python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" || {
  echo "gpu_check: python3 sees no CUDA device; on a CPU machine run scripts/gpu_check.sh --cpu" >&2; exit 2; }
if ls .gpu/wheels/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    .gpu/wheels/*.whl
  export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
fi
if [ -d .gpu/data ]; then export EVOSPEC_DATA_DIR="$(pwd)/.gpu/data"; fi
root=$(pwd)
path=$(mktemp -d)
mkdir -p "$path/evospec"
for entry in "$root"/evospec/*; do ln -s "$entry" "$path/evospec/"; done
for sub in bench kernels loadtest orchestration services; do ln -s "$root/$sub" "$path/evospec/$sub"; done
ln -s "$root/client/evospec_client" "$path/evospec_client"
# PYTHONSAFEPATH: `python3 -m` would otherwise put the repo root first on the path, where ./evospec lacks the
# subpackages the links add (evospec.bench, ...).
export PYTHONPATH="$path${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 PYTHONSAFEPATH=1
exec python3 -m evospec.bench.gpu_check "$@"

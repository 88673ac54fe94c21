#!/usr/bin/env bash
# Set up (idempotent) and run the main job on the embedded default: measure this host on the
# qwen3-tiny preset and print the per-block summary. Extra arguments go to `torchpp profile`.
set -euo pipefail
cd "$(dirname "$0")/.."
VPY=$(bash launch/setup.sh)
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
HOST=${TORCHPP_HOST:-$(hostname)}
mkdir -p out
exec "$VPY" -m torchpp profile --model qwen3-tiny --seq-len 128 --batch 2 --iters 6 --warmup 2 --threads 1 \
  --host "$HOST" --out "out/layers_$HOST.json" --trace "out/profile_trace_$HOST.json" "$@"

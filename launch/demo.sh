#!/usr/bin/env bash
# Set up (idempotent) and run the main job on the embedded default. Extra arguments go to `torchpp demo`.
set -euo pipefail
cd "$(dirname "$0")/.."
VPY=$(bash launch/setup.sh)
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
exec "$VPY" -m torchpp plan --strategy even --stages 2 --out out/plan.json "$@"

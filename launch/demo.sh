#!/usr/bin/env bash
# Set up (idempotent) and run the main job on the embedded default: `torchpp demo`, the whole
# loop (profile each host, plan, train with traces, analyse, replan, train again) on the
# emulated hetero4 cluster where this machine allows it, else on local processes.
# Extra arguments go to `torchpp demo` (e.g. --local, --quick, --out DIR).
set -euo pipefail
cd "$(dirname "$0")/.."
VPY=$(bash launch/setup.sh)
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
exec "$VPY" -m torchpp demo "$@"

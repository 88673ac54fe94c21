#!/usr/bin/env bash
# Set up (idempotent) and run the main job on the embedded default: `torchpp demo`, the whole
# loop (profile each host, plan, train with traces, analyse, replan, train again) on the
# emulated homelab cluster (an old laptop and three Raspberry Pis, and a model none of them can
# train alone) where this machine allows it, else on local processes. Its closing table puts the
# plan next to the best single device, data parallelism, the even 1F1B split and the lower bound.
# Extra arguments go to `torchpp demo` (e.g. --scenario hetero4, --scenario slowlink, --local,
# --quick, --out DIR).
set -euo pipefail
cd "$(dirname "$0")/.."
VPY=$(bash launch/setup.sh)
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
exec "$VPY" -m torchpp demo "$@"

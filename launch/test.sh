#!/usr/bin/env bash
# Set up (idempotent) and run the test suite. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
VPY=$(bash launch/setup.sh)
export HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
exec "$VPY" -m pytest -q -p no:cacheprovider "$@" tests

#!/usr/bin/env bash
# Create (or reuse) .venv with the pinned CPU torch and build torchpp's C++ timer.
# Idempotent: a second run only checks a stamp of the inputs and returns.
# Prints the venv's python on stdout; everything else goes to stderr.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=${TORCHPP_VENV:-.venv}
export HF_HUB_OFFLINE=1 PIP_DISABLE_PIP_VERSION_CHECK=1
if [ ! -x "$VENV/bin/python" ]; then
  echo "[setup] creating $VENV" >&2
  "$PY" -m venv "$VENV"
fi
VPY="$VENV/bin/python"
inputs=$(find requirements.txt requirements-hta.txt setup.py csrc -type f 2>/dev/null | sort || true)
stamp="$VENV/.torchpp-setup-$(cat $inputs | sha1sum | cut -c1-12)"
if [ ! -f "$stamp" ]; then
  echo "[setup] installing requirements into $VENV (torch pinned to 2.13.0, CPU build)" >&2
  "$VPY" -m pip install -q --upgrade pip wheel setuptools >&2
  # torch first and alone, pinned, so nothing later can pull a CUDA build.
  "$VPY" -m pip install -q "torch==2.13.0" >&2
  "$VPY" -m pip install -q -r requirements.txt >&2
  # HTA without its declared jupyterlab (a notebook server it does not import): see requirements-hta.txt
  "$VPY" -m pip install -q --no-deps -r requirements-hta.txt >&2
  echo "[setup] building torchpp and its C++ timer (no build isolation)" >&2
  if ! "$VPY" -m pip install -q --no-build-isolation -e . >&2; then
    echo "[setup] WARNING: the C++ timer did not compile; installing torchpp with its Python timer instead" >&2
    TORCHPP_NO_EXT=1 "$VPY" -m pip install -q --no-build-isolation -e . >&2
  fi
  rm -f "$VENV"/.torchpp-setup-*
  touch "$stamp"
fi
echo "$VPY"

#!/usr/bin/env bash
# Build a fresh virtual environment with megatron_rl and its test extras.
#   VENV=path (default .venv)   EXTRAS=test (pip extras to install)
# On a machine without an NVIDIA driver the CPU build of torch 2.13.0 is installed first, so that
# no dependency pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
EXTRAS=${EXTRAS:-test}
PY=${PYTHON:-python3}
if [ "${FRESH:-1}" = 1 ] && [ -d "$VENV" ]; then rm -rf "$VENV"; fi
if [ ! -x "$VENV/bin/python" ]; then "$PY" -m venv "$VENV"; fi
. "$VENV/bin/activate"
export PIP_DISABLE_PIP_VERSION_CHECK=1
pip install -q --upgrade pip setuptools wheel
if ! command -v nvidia-smi >/dev/null 2>&1; then
  pip install -q "torch==2.13.0"
fi
pip install -q -e ".[${EXTRAS}]"
python -c "import torch, megatron.core, megatron_rl; print('megatron_rl ready: torch', torch.__version__, '| megatron-core', megatron.core.__version__)"

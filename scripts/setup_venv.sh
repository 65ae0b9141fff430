#!/usr/bin/env bash
# Build the virtual environment with megatron_rl and its test extras, or reuse it when it is current.
#   VENV=path (default .venv)   EXTRAS=test (pip extras to install)
#   MCORE=version (default: empty, i.e. what setup.py's range resolves to: 0.16.1 on Python 3.11): install that
#   megatron-core release first, with --ignore-requires-python (0.17+ declare Python >= 3.12; their cp311 wheel
#   runs here), e.g. MCORE=0.19.2 for the tested range's upper end (scripts/test.sh)
#   FRESH=auto (default): reuse $VENV when its requirements stamp (setup.py, this script, EXTRAS, MCORE, python,
#   GPU or not) matches, else rebuild it; FRESH=1 always rebuilds; FRESH=0 reuses whatever is there.
# On a machine without an NVIDIA driver the CPU build of torch 2.13.0 is installed first, so that
# no dependency pulls a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
EXTRAS=${EXTRAS:-test}
PY=${PYTHON:-python3}
FRESH=${FRESH:-auto}
MCORE=${MCORE:-}
STAMP_FILE="$VENV/.megatron_rl_requirements"
GPU=0; if command -v nvidia-smi >/dev/null 2>&1; then GPU=1; fi
STAMP=$({ cat setup.py scripts/setup_venv.sh; echo "extras=$EXTRAS mcore=$MCORE gpu=$GPU $("$PY" -V 2>&1)"; } | sha256sum | cut -d' ' -f1)
if [ "$FRESH" = auto ]; then
  if [ -x "$VENV/bin/python" ] && [ "$(cat "$STAMP_FILE" 2>/dev/null)" = "$STAMP" ]; then
    echo "setup_venv: reusing $VENV (built from the current setup.py; FRESH=1 rebuilds it)"
    exit 0
  fi
  FRESH=1
fi
if [ "$FRESH" = 1 ] && [ -e "$VENV" ]; then
  echo "setup_venv: rebuilding $VENV (its requirements stamp is missing or out of date, or FRESH=1)"
  rm -rf "$VENV"
fi
if [ ! -x "$VENV/bin/python" ]; then "$PY" -m venv "$VENV"; fi
. "$VENV/bin/activate"
export PIP_DISABLE_PIP_VERSION_CHECK=1
pip install -q --upgrade pip setuptools wheel
if [ "$GPU" = 0 ]; then
  pip install -q "torch==2.13.0"
fi
if [ -n "$MCORE" ]; then
  # before the editable install, which keeps it (setup.py's range) and resolves its requirements (torch, numpy,
  # packaging); --no-deps: --ignore-requires-python would also let pip pick a numpy that needs Python 3.12
  pip install -q --no-deps --ignore-requires-python "megatron-core==$MCORE"
fi
pip install -q -e ".[${EXTRAS}]"
python -c "import torch, megatron.core, megatron_rl; print('megatron_rl ready: torch', torch.__version__, '| megatron-core', megatron.core.__version__)"
if [ -n "$MCORE" ]; then
  python -c "import sys, megatron.core as m; v = m.__version__; sys.exit(0 if v.split('+')[0] == '$MCORE' else f'setup_venv: MCORE=$MCORE but megatron-core {v} is installed')"
fi
echo "$STAMP" > "$STAMP_FILE"

#!/usr/bin/env bash
# The README's main command: build a fresh virtual environment, then run the tiny CPU recipe
# (examples/tiny_cpu.yaml: assets generated locally, ~4 minutes on 2 CPU cores).
#   VENV=path (default .venv)   FRESH=0 to reuse an existing venv
#   Extra arguments are overrides, e.g. `bash scripts/run_tiny.sh steps=50 logging.output_dir=runs/try`
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv} EXTRAS=${EXTRAS:-test} bash scripts/setup_venv.sh
. "${VENV:-.venv}/bin/activate"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} RAY_USAGE_STATS_ENABLED=0 TOKENIZERS_PARALLELISM=false
# overwrite=true: re-running the command starts the run over (resume=true continues it instead)
megatron-rl train examples/tiny_cpu.yaml overwrite=true "$@"

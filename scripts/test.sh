#!/usr/bin/env bash
# Set up a fresh virtual environment and run the whole test suite (what CI runs).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh tests/unit -x`.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv} bash scripts/setup_venv.sh
# SGLang 0.5.23's own code (CPU) judges our SGLang side: tests/unit/test_sglang_contract.py must not skip here
bash scripts/setup_sglang_venv.sh
export MEGATRON_RL_REQUIRE_SGLANG=1
. "${VENV:-.venv}/bin/activate"
if [ "${WITH_SLURM:-0}" = 1 ]; then
  # root + Debian: a local 2-node SLURM for tests/distributed/test_slurm_job.py (installs slurm-wlm and munge
  # when missing); the daemons it starts here (munged, slurmctld, slurmd x2) are stopped when the tests end
  STARTED=$(mktemp)
  trap 'STARTED=$STARTED bash scripts/setup_slurm.sh --stop; rm -f "$STARTED"' EXIT
  STARTED=$STARTED bash scripts/setup_slurm.sh
fi
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} RAY_USAGE_STATS_ENABLED=0 TOKENIZERS_PARALLELISM=false
python -m pytest -q "$@"

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
python -m pytest -q --durations=30 "$@"
if [ "$#" -eq 0 ] && [ "${MCORE_UPPER:-1}" = 1 ]; then
  # The other end of setup.py's megatron-core range (>=0.16.1,<0.20; .venv resolves 0.16.1 on Python 3.11):
  # the core trainer tests on 0.19.2 in a venv of their own (MCORE_UPPER=0 skips this step).
  VENV=.venv-mcore-019 MCORE=0.19.2 bash scripts/setup_venv.sh
  .venv-mcore-019/bin/python -m pytest -q -p no:cacheprovider tests/unit/test_model_config.py \
    tests/distributed/test_compat_training.py tests/distributed/test_model_pipeline_backward.py \
    tests/distributed/test_deepseek_replay.py
fi

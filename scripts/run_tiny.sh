#!/usr/bin/env bash
# The README's main command: the virtual environment (built, or reused when current: scripts/setup_venv.sh),
# then the tiny CPU recipe (examples/tiny_cpu.yaml: assets generated locally, a few minutes on 2 CPU cores).
#   VENV=path (default .venv)   FRESH=1 rebuilds the venv
#   Extra arguments are overrides, e.g. `bash scripts/run_tiny.sh steps=50 logging.output_dir=runs/try`
# An earlier run in the output directory is moved aside, with a message, never erased; with resume=true or
# overwrite=true among the arguments, `megatron-rl train` decides (continue it, or delete its outputs).
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
VENV=$VENV EXTRAS=${EXTRAS:-test} bash scripts/setup_venv.sh
. "$VENV/bin/activate"
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} RAY_USAGE_STATS_ENABLED=0 TOKENIZERS_PARALLELISM=false
OUT=runs/tiny_cpu
DECIDED=0
for arg in "$@"; do
  case "$arg" in
    logging.output_dir=*) OUT=${arg#*=} ;;
    resume=*|overwrite=*) DECIDED=1 ;;
  esac
done
if [ "$DECIDED" = 0 ] && [ -d "$OUT" ] && [ -n "$(ls -A "$OUT")" ]; then
  OLD="$OUT.$(date +%Y%m%d-%H%M%S)"
  mv "$OUT" "$OLD"
  echo "run_tiny: the earlier run in $OUT is now in $OLD (resume=true continues a run, overwrite=true replaces it)"
fi
megatron-rl train examples/tiny_cpu.yaml "$@"
cat <<NEXT

Next (or first: . $VENV/bin/activate):
  $VENV/bin/megatron-rl report $OUT        # $OUT/report/index.html
  $VENV/bin/megatron-rl export $OUT/checkpoints $OUT/hf
  $VENV/bin/megatron-rl eval $OUT eval.k=8
NEXT

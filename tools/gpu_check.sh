#!/usr/bin/env bash
# The prepared GPU check (what it measures: tools/gpu_check.py). One run, <= 8 minutes on one H200.
#
#   bash tools/gpu_check.sh                  # GPU machine: full sizes; JSON to $OUT/gpu_check.json if $OUT is set
#   bash tools/gpu_check.sh --cpu            # small sizes on CPU (CI: tests/unit/test_gpu_check.py)
#   bash tools/gpu_check.sh --fetch-wheels   # here, with network: wheels the bare GPU machine lacks, into .whl/
#
# A bare GPU machine (torch + Triton + transformers, no network, no Megatron) gets megatron-core from the
# ignored folder .whl/ (fetched by --fetch-wheels for CPython 3.12, manylinux x86-64; 2.6 MB), installed
# into /tmp/gpu_check_site. Carry .whl with the working tree. PYTHON picks the interpreter (default python3).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
WHEELS=(megatron-core==0.16.1)  # its own requirements (torch, numpy, packaging) are on the GPU image
if [ "${1:-}" = "--fetch-wheels" ]; then
  exclude=$(git rev-parse --git-path info/exclude)  # keep the wheels out of git (they travel as carried files)
  grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
  exec "$PY" -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl "${WHEELS[@]}"
fi
if ! "$PY" -c "import megatron.core" >/dev/null 2>&1; then
  if ls .whl/*.whl >/dev/null 2>&1; then
    "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/gpu_check_site \
      .whl/*.whl || exit 3
    export PYTHONPATH=/tmp/gpu_check_site${PYTHONPATH:+:$PYTHONPATH}
  else
    echo "megatron-core is not installed and .whl/ holds no wheels: run 'bash tools/gpu_check.sh --fetch-wheels'" \
         "where pip has network, and carry .whl" >&2
  fi
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 OMP_NUM_THREADS=${OMP_NUM_THREADS:-4}
export TRITON_DEFAULT_FP_FUSION=${TRITON_DEFAULT_FP_FUSION:-1}
timeout "${GPU_CHECK_TIMEOUT_S:-480}" "$PY" tools/gpu_check.py "$@"
rc=$?

# ---- section: throughput (issue 23) -------------------------------------------------------------------------
# Trainer tokens/s, MFU, peak memory of 0.6B/1.7B/4B Qwen3-shaped random models (tools/gpu_throughput.py).
# Guarded: its failure is reported and changes the exit status, the sections above are kept. On GPU it runs
# unless GPU_CHECK_THROUGHPUT=0; with --cpu only when GPU_CHECK_THROUGHPUT=1 (a tiny shape: the script runs).
want=${GPU_CHECK_THROUGHPUT:-}
[ "${1:-}" = "--cpu" ] && want=${want:-0} && targs=(--cpu) || { want=${want:-1}; targs=(); }
if [ "$want" = "1" ]; then
  echo "### throughput"
  timeout "${GPU_THROUGHPUT_TIMEOUT_S:-420}" "$PY" tools/gpu_throughput.py "${targs[@]}" --timeout-s 200 \
    || { echo "### throughput: FAILED (exit $?)"; rc=1; }
fi
exit $rc

#!/usr/bin/env bash
# Build the venv that imports SGLang 0.5.23's own code on CPU for the contract tests
# (tests/sglang_side/README.md): its request classes and HTTP routes, init_custom_process_group and
# the weight updater, MultiprocessingSerializer, the routed-experts encoder. It cannot run the engine.
#   SGLANG_VENV=path (default .venv-sglang)   FRESH=1 rebuilds it   PYTHON=python3.11
# A venv built from the same scripts/sglang_venv_requirements.txt that imports cleanly is reused.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${SGLANG_VENV:-.venv-sglang}
PY=${PYTHON:-python3}
REQS=scripts/sglang_venv_requirements.txt
STAMP="$VENV/.requirements.sha256"
start=$(date +%s)
fail() { echo "setup_sglang_venv: $*" >&2; exit 1; }

check_imports() {
  "$VENV/bin/python" -W ignore - <<'EOF'
import sglang, torch
assert sglang.__version__ == "0.5.23", sglang.__version__
import sglang.srt.entrypoints.api_contract  # noqa: F401
import sglang.srt.entrypoints.http_server  # noqa: F401
import sglang.srt.managers.detokenizer_manager  # noqa: F401
import sglang.srt.managers.tp_worker  # noqa: F401
import sglang.srt.model_executor.model_runner_components.weight_updater  # noqa: F401
import sglang.srt.state_capturer.routed_experts  # noqa: F401
from sglang.srt.utils.common import MultiprocessingSerializer, init_custom_process_group  # noqa: F401
print("sglang", sglang.__version__, "| torch", torch.__version__)
EOF
}

want=$(sha256sum "$REQS" | cut -d' ' -f1)
if [ "${FRESH:-0}" = 1 ]; then rm -rf "$VENV"; fi
if [ -x "$VENV/bin/python" ] && [ "$(cat "$STAMP" 2>/dev/null)" = "$want" ] && check_imports; then
  echo "setup_sglang_venv: reusing $VENV"
else
  "$PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' \
    || fail "needs Python 3.11 (sglang 0.5.23's wheel is cp311); set PYTHON=python3.11"
  rm -rf "$VENV"
  "$PY" -m venv "$VENV" || fail "python -m venv $VENV failed"
  log=$(mktemp)
  PIP_DISABLE_PIP_VERSION_CHECK=1 "$VENV/bin/pip" install -q --no-deps --no-compile -r "$REQS" >"$log" 2>&1 \
    || { grep -v "is ignored: it is neither" "$log" >&2; fail "pip install -r $REQS failed (pip's output above)"; }
  rm -f "$log"
  check_imports || fail "the SGLang imports fail in $VENV (traceback above): a package is missing from $REQS"
  echo "$want" > "$STAMP"
fi
echo "setup_sglang_venv: $VENV ready in $(( $(date +%s) - start )) s, $(du -sh "$VENV" | cut -f1)"

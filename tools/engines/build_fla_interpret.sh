#!/usr/bin/env bash
# Build a virtual environment, separate from the project's .venv, in which the fla kernels run on
# CPU under Triton's interpreter: the CPU torch wheel, triton, flash-linear-attention and this
# project (editable, with its test extras). The opt-in tests `pytest -m fla_interpret` run there.
#
#   usage: tools/engines/build_fla_interpret.sh [VENV_DIR]
#   default VENV_DIR: $HOME/.cache/dflash-pipeline/fla-interpret-venv
#   env:   PYTHON (interpreter for the venv; default python3)
#          TRITON_VERSION (default 3.7.1), FLA_VERSION (default 0.6.0)
#
# Idempotent: exits at once when VENV_DIR/bin/python imports triton, fla and this project.
# Never install triton into the project's own .venv on a CPU machine: transformers then picks
# the fla kernels and every forward outside the interpreter crashes.
set -euo pipefail

VENV="${1:-$HOME/.cache/dflash-pipeline/fla-interpret-venv}"
TRITON_VERSION="${TRITON_VERSION:-3.7.1}"
FLA_VERSION="${FLA_VERSION:-0.6.0}"
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"

log() { printf '[build_fla_interpret] %s\n' "$*" >&2; }

works() {
  [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import triton, fla, store, pipeline" >/dev/null 2>&1
}

if works; then
  log "already built: $VENV ($("$VENV/bin/python" -c 'import triton, fla; print("triton", triton.__version__, "fla", fla.__version__)'))"
  exit 0
fi
[ -e "$VENV" ] && { log "removing broken/partial venv at $VENV"; rm -rf "$VENV"; }
start=$(date +%s)
"${PYTHON:-python3}" -m venv "$VENV"
pip=("$VENV/bin/pip" install -q --no-compile)
"${pip[@]}" torch==2.13.0
"${pip[@]}" "triton==$TRITON_VERSION" "flash-linear-attention==$FLA_VERSION"
"${pip[@]}" -e "$ROOT[test]"
works || { log "built, but triton/fla/the project do not import; see above"; exit 1; }
log "built $VENV in $(( $(date +%s) - start )) s"

#!/usr/bin/env bash
# Build a virtual environment holding moto's S3 API server (registry package `moto[server]`),
# separate from the project's .venv: the opt-in object-store tests (`pytest -m s3`) start it on
# 127.0.0.1 and talk to it through s3fs, as a job talks to a real object store.
#
#   usage: tools/s3/build_moto.sh [VENV_DIR]
#   default VENV_DIR: $HOME/.cache/dflash-pipeline/moto-venv
#
# Idempotent: exits at once when VENV_DIR/bin/moto_server exists and imports.
set -euo pipefail
venv=${1:-$HOME/.cache/dflash-pipeline/moto-venv}
if [ -x "$venv/bin/moto_server" ] && "$venv/bin/python" -c "import moto.server" 2>/dev/null; then
  exit 0
fi
python3 -m venv "$venv"
"$venv/bin/pip" install -q 'moto[server]>=5'
"$venv/bin/python" -c "import moto; print('moto', moto.__version__, 'in', '$venv')"

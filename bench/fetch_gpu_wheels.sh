#!/usr/bin/env bash
# Fetch, on a machine with a registry, the wheels a GPU machine without one lacks for bench/gpu_check.sh,
# each at the version .ci/tested-versions.txt names (python -m bench.gpu_wheels follows their requirements;
# the image keeps its own CUDA torch, triton and numpy). They land in .whl/ (git-ignored, emptied first);
# carry that folder to the GPU machine. PYVER: the GPU machine's CPython (default 3.12).
set -euo pipefail
cd "$(dirname "$0")/.."
rm -rf .whl
python3 -m bench.gpu_wheels fetch .whl --python "${PYVER:-3.12}"
du -sh .whl

#!/usr/bin/env bash
# Fetch, on a machine with a registry, the wheels a GPU machine without one lacks for
# bench/gpu_check.sh (its image has torch, triton, transformers, accelerate, click, tqdm,
# fsspec, einops). They land in .whl/ (git-ignored); carry that folder to the GPU machine.
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYVER:-3.12}
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64
      --platform manylinux2014_x86_64 --platform manylinux1_x86_64)
for spec in flash-linear-attention==0.6.0 fla-core==0.6.0 zarr==3.1.6 numcodecs==0.16.6 donfig==0.8.1.post1 \
            google-crc32c==1.8.0 "transformers==5.24.0"; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version "$py" --implementation cp \
    "${plat[@]}" -d .whl "$spec"
done
ls -la .whl

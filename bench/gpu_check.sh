#!/usr/bin/env bash
# GPU check (run on a CUDA machine from the repo root; writes bench/gpu/ or $OUT):
#  1. extract shards 0-3 twice on CUDA in bf16, once with the fla kernels (under torchrun, one rank
#     per visible GPU) and once with the PyTorch
#     fallback, over the SAME token sequences (--responses dataset), and compare the stored states
#     per tap (cosine similarity, max abs difference); each store records the backend that ran;
#  2. extraction throughput with the fla kernels (regenerate mode, the default job);
#  3. stage two: flex_attention vs the block-local SDPA path (outputs, gradients; fp32 and bf16) and
#     a short bf16 training run (steps/s, tokens/s, peak memory) on the fla store;
#  4. evaluate that drafter by replay and live on CUDA (fla kernels, state rollback), replay == live count;
#  5. serial against batched replay on CUDA with a random drafter of hidden 2048 (lane-rounds/s, same rounds);
#  6. peak host RSS while a 1.1 GB target loads onto the GPU, straight onto it against host-then-move.
# Wheels the machine lacks: bench/fetch_gpu_wheels.sh puts them in .whl/ first.
set -euo pipefail
cd "$(dirname "$0")/.."
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
out=${OUT:-bench/gpu}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, transformers, fla, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'fla', fla.__version__, 'triton', triton.__version__)" | tee -a "$out/gpu.txt"
common=(--shards 0-3 --device cuda --dtype bf16 --responses dataset --max-length 1024 --batch-size 16)
rm -rf /tmp/fla.zarr /tmp/torch.zarr
gpus=$(nvidia-smi -L | wc -l)  # the launcher path: one rank per visible GPU, shards claimed as they go
python3 -m torch.distributed.run --standalone --nproc_per_node "$gpus" -m pipeline extract --store /tmp/fla.zarr \
  --linear-attention fla "${common[@]}" 2>&1 | tee "$out/extract_fla.txt"
python3 -m pipeline extract --store /tmp/torch.zarr --linear-attention torch "${common[@]}" 2>&1 | tee "$out/extract_torch.txt"
python3 -m pipeline info /tmp/fla.zarr | tee "$out/info_fla.txt"
python3 -m pipeline info /tmp/torch.zarr | tee "$out/info_torch.txt"
python3 bench/compare_stores.py /tmp/fla.zarr /tmp/torch.zarr --json "$out/compare.json" | tee "$out/compare.md"
python3 bench/extract_bench.py --device cuda --shards 0-15 --repeat 3 --json "$out/bench.json" | tee "$out/bench.md"
rm -rf /tmp/gpu_run
python3 bench/gpu_train_check.py --store /tmp/fla.zarr --run-dir /tmp/gpu_run --json "$out/train.json" 2>&1 | tee "$out/train.txt"
python3 evaluate.py --store /tmp/fla.zarr --checkpoint /tmp/gpu_run/final --shards 0-3 --live \
  --target pipeline/assets/tiny_target --device cuda --out "$out/eval" 2>&1 | tee "$out/eval.txt"
python3 bench/replay_bench.py --device cuda --width 2048 --vocab 65536 --prompts 32 --slots 1,32 --repeat 1 \
  --json "$out/replay.json" 2>&1 | tail -5 | tee "$out/replay.txt"
python3 bench/target_load_bench.py --device cuda --dtype bf16 --json "$out/target_load.json" 2>&1 | tail -4 | tee "$out/target_load.txt"

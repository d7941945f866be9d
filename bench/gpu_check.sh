#!/usr/bin/env bash
# GPU check (run on a CUDA machine from the repo root; sized to fit 8 minutes on one H100 or H200, run
# it with a 600 s limit; never run yet in this form, the step limits below are its budget; writes
# bench/gpu/, or $OUT/gpu_check.tar.gz plus $OUT/summary.txt where $OUT is set):
#  1. parity: extract shards 0-3 twice on CUDA in bf16, once with the fla kernels (under torchrun, one
#     rank per visible GPU) and once with the PyTorch fallback, over the SAME token sequences
#     (--responses dataset), and compare the stored states per tap (python -m bench.parity compare:
#     cosine similarity, max abs difference); each store records the backend that ran;
#  2. real width (python -m bench.real_width_bench): the bf16 matmul roofline; the full-depth
#     Qwen3.6-27B-shaped target (64 layers, hidden 5120, vocabulary 248,320, random weights built on
#     the GPU) capturing sequences of 1-8k tokens through Target.capture with the fla kernels against
#     the same forward without capture (tokens/s, MFU against the roofline, the capture's share);
#     drafter training at width 5120 (1.73B, Muon, bf16 autocast, flex: tokens/s, MFU, peak memory,
#     the largest batch that fits); replay rounds/s of a width-5120 drafter (python -m
#     bench.eval_bench replay --width 5120 --vocab 248320).
# With ALL=1 the tiny target's stage-two and evaluation checks run too (about 4 more minutes on an
# H200 on 2026-12-04: a bf16 training run on the target's greedy completions, flex against SDPA,
# replay against live decoding with the fla kernels' state rollback, extraction throughput).
# Each step runs under its own time limit and a failing step does not stop the later ones: the
# summary lists every step's exit status and seconds; versions.txt lists every library's version against
# .ci/tested-versions.txt. Wheels the machine lacks, at the tested versions: bench/fetch_gpu_wheels.sh puts
# them in .whl/ first.
set -uo pipefail
cd "$(dirname "$0")/.."
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
out=bench/gpu; [ -n "${OUT:-}" ] && out=/tmp/gpu_check
mkdir -p "$out"; : > "$out/summary.txt"
step() {  # step NAME SECONDS COMMAND...: output to $out/NAME.txt, status and time to the summary
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$out/$name.txt" 2>&1; local rc=$?
  printf '%-14s rc=%-3s %4ss\n' "$name" "$rc" "$((SECONDS - t0))" | tee -a "$out/summary.txt"
  tail -3 "$out/$name.txt"
  if [ -n "${OUT:-}" ]; then  # what ran so far comes back even if a later step outlasts the call
    tar -czf "$OUT/gpu_check.tar.gz" -C "$out" . && cp "$out/summary.txt" "$OUT/"
  fi
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv | tee "$out/gpu.txt"
python3 -c "import torch, transformers, fla, triton, zarr; print('torch', torch.__version__, 'transformers', transformers.__version__, 'fla', fla.__version__, 'triton', triton.__version__, 'zarr', zarr.__version__)" 2>&1 | tee -a "$out/gpu.txt"
python3 -m bench.gpu_wheels versions > "$out/versions.txt" 2>&1  # every library against .ci/tested-versions.txt
grep -E "differs|image" "$out/versions.txt"
common=(--shards 0-3 --device cuda --dtype bf16 --responses dataset --max-length 1024 --batch-size 16)
rm -rf /tmp/fla.zarr /tmp/torch.zarr /tmp/regen.zarr /tmp/gpu_run
gpus=$(nvidia-smi -L | wc -l)  # the launcher path: one rank per visible GPU, shards claimed as they go
step extract_fla 110 python3 -m torch.distributed.run --standalone --nproc_per_node "$gpus" -m pipeline extract \
  --store /tmp/fla.zarr --linear-attention fla "${common[@]}"
step extract_torch 40 python3 -m pipeline extract --store /tmp/torch.zarr --linear-attention torch "${common[@]}"
step info_fla 10 python3 -m pipeline info /tmp/fla.zarr
step info_torch 10 python3 -m pipeline info /tmp/torch.zarr
step compare 20 python3 -m bench.parity compare /tmp/fla.zarr /tmp/torch.zarr --json "$out/compare.json" --force
step real_roofline 20 python3 -m bench.real_width_bench roofline --device cuda --json "$out/real_roofline.json" --force
step real_capture 130 python3 -m bench.real_width_bench capture --device cuda --arch qwen3.6-27b --linear-attention fla \
  --tokens 32768 --capture-tokens 32768 --lengths 2048,4096,1024,8192 --json "$out/real_capture.json" --force
step real_train 80 python3 -m bench.real_width_bench train --device cuda --arch qwen3.6-27b --context 4096 \
  --anchors 512 --max-batch 8 --json "$out/real_train.json" --force
step real_replay 60 python3 -m bench.eval_bench replay --device cuda --width 5120 --vocab 248320 --prompts 4 \
  --slots 1,4 --repeat 1 --json "$out/real_replay.json" --force
if [ -n "${ALL:-}" ]; then
  step extract_regen 90 python3 -m pipeline extract --store /tmp/regen.zarr --linear-attention fla --shards 0-3 \
    --device cuda --dtype bf16 --max-length 1024 --batch-size 16
  step train 90 python3 -m bench.train_bench gpu --store /tmp/regen.zarr --steps 30 --run-dir /tmp/gpu_run \
    --json "$out/train.json" --force
  step eval 90 python3 evaluate.py --store /tmp/regen.zarr --checkpoint /tmp/gpu_run/final --shards 0-3 --live \
    --live-prompts 8 --target pipeline/assets/tiny_target --device cuda --out "$out/eval" --force
  step extract_bench 90 python3 -m bench.extract_bench --device cuda --shards 0-3 --repeat 1 --json "$out/bench.json" --force
fi
cat "$out/summary.txt"

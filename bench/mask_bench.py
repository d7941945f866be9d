"""Building the flex BlockMask on CPU: torch's create_block_mask over the dense predicate (what
masks.block_mask did before) against masks.block_mask, which classifies the tiles from the block
structure (a measurement, not a test).

    python bench/mask_bench.py --repeat 3

Anchors are drawn as training draws them (sample_anchors over a sequence whose tokens all carry
loss) and padded as CUDA training pads them (stages/train/step.py pad_for_compile: N to --anchors,
the context to a multiple of 512). Each shape is timed for the two rules of the released
Qwen3.6-27B drafter: sliding (causal, window 2048) and full attention (bidirectional in the block).
Both constructions must give the same BlockMask (checked on every shape before timing). Reports
the median over the repeats, in milliseconds, and writes JSON. `of_which_tile_kinds_ms` is the
classification alone; the rest of the new construction is BlockMask.from_kv_blocks deriving the
query-side tables that the backward pass reads (torch's code, the same in both constructions).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
from torch.nn.attention.flex_attention import create_block_mask  # noqa: E402

from pipeline.drafter.blocks import sample_anchors  # noqa: E402
from pipeline.drafter.masks import LayerRule, allowed, block_mask, tile_kinds  # noqa: E402
from stages.train.step import pad_for_compile  # noqa: E402

SHAPES = {"27B (batch 1, N 512, B 16, S 4096)": (1, 512, 16, 4096),
          "small (batch 2, N 128, B 16, S 1024)": (2, 128, 16, 1024)}
RULES = {"sliding causal w2048": LayerRule(causal=True, window=2048), "full": LayerRule()}
FIELDS = ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices")


def dense_built(anchors, valid, ctx_len: int, block_size: int, rule: LayerRule):
    """The previous construction: torch evaluates the predicate at every (query, key)."""
    batch, n = anchors.shape

    def mask_mod(b, _h, q_idx, kv_idx):
        return allowed(b, q_idx, kv_idx, anchors=anchors, valid=valid, ctx_len=ctx_len, block_size=block_size,
                       rule=rule)

    return create_block_mask(mask_mod, B=batch, H=None, Q_LEN=n * block_size, KV_LEN=ctx_len + n * block_size,
                             device=anchors.device)


def training_anchors(batch: int, n: int, length: int, seed: int):
    """anchors, valid [batch, n] and the context length, as a CUDA training step makes them."""
    g = torch.Generator().manual_seed(seed)
    anchors, valid = sample_anchors(torch.ones(batch, length, dtype=torch.bool), n, generator=g)
    return pad_for_compile(anchors, valid, int(anchors.max()), n)


def median_ms(fn, repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e3)
    return statistics.median(times)


def measure(shape, rule: LayerRule, repeat: int) -> dict:
    batch, n, block, length = shape
    anchors, valid, ctx_len = training_anchors(batch, n, length, seed=0)
    old, new = dense_built(anchors, valid, ctx_len, block, rule), block_mask(anchors, valid, ctx_len, block, rule)
    same = all(torch.equal(getattr(old, f), getattr(new, f)) for f in FIELDS)
    if not same:
        raise SystemExit(f"block_mask differs from create_block_mask at {shape}, {rule}")
    old_ms = median_ms(lambda: dense_built(anchors, valid, ctx_len, block, rule), repeat)
    new_ms = median_ms(lambda: block_mask(anchors, valid, ctx_len, block, rule), max(repeat, 5))
    tiles_ms = median_ms(lambda: tile_kinds(anchors, valid, ctx_len, block, rule), max(repeat, 5))
    return {"batch": batch, "anchors": n, "block_size": block, "ctx_len": ctx_len,
            "elements": batch * n * block * (ctx_len + n * block), "tiles": new.kv_indices.numel(),
            "partial_tiles": int(new.kv_num_blocks.sum()), "full_tiles": int(new.full_kv_num_blocks.sum()),
            "create_block_mask_ms": round(old_ms, 2), "from_block_structure_ms": round(new_ms, 3),
            "of_which_tile_kinds_ms": round(tiles_ms, 3),
            "speedup": round(old_ms / new_ms, 1), "identical": same}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3, help="timed builds per construction (the new one at least 5)")
    ap.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    ap.add_argument("--json", default=None, help="write the result here (the committed one: bench/results/mask_cpu.json); "
                    "without it the result is printed only")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    results = {}
    for name, shape in SHAPES.items():
        for rule_name, rule in RULES.items():
            r = measure(shape, rule, args.repeat)
            results[f"{name}, {rule_name}"] = r
            print(f"{name}, {rule_name}: create_block_mask {r['create_block_mask_ms']:.1f} ms, from the block "
                  f"structure {r['from_block_structure_ms']:.2f} ms ({r['speedup']}x; tile kinds "
                  f"{r['of_which_tile_kinds_ms']:.2f} ms); {r['partial_tiles']} partial + {r['full_tiles']} full "
                  f"of {r['tiles']} tiles", flush=True)
    record = {"command": "python bench/mask_bench.py " + " ".join(sys.argv[1:]), "args": vars(args),
              "machine": {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(),
                          "python": platform.python_version(), "torch": torch.__version__},
              "results": results}
    print(json.dumps(record, indent=1))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()

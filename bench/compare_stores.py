"""Per-tap agreement of two stores over the same token sequences (e.g. fla kernels vs PyTorch fallback).

    python bench/compare_stores.py A.zarr B.zarr [--json out.json]

Both stores must hold the same samples (make them with `--responses dataset`, so the token
sequences cannot differ). For each tap: mean and minimum per-token cosine similarity, max and mean
absolute difference, and the share of bf16 values that are bit-identical.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from store.hidden_store import HiddenStore  # noqa: E402
from store.shard_reader import ShardReader  # noqa: E402


def compare(a: HiddenStore, b: HiddenStore) -> dict:
    taps = a.attrs.taps
    if b.attrs.taps != taps:
        raise SystemExit(f"taps differ: {taps} vs {b.attrs.taps}")
    shards = sorted(set(a.committed()) & set(b.committed()))
    cos, maxabs, sumabs, same, count = [[] for _ in taps], [0.0] * len(taps), [0.0] * len(taps), [0] * len(taps), 0
    for shard in shards:
        for sa, sb in zip(ShardReader(a, shard), ShardReader(b, shard)):
            if not torch.equal(sa.tokens, sb.tokens):
                raise SystemExit(f"shard {shard} sample {sa.index}: token sequences differ; use --responses dataset")
            x, y = sa.hidden.float(), sb.hidden.float()  # [T, n_taps, H]
            count += len(x)
            for j in range(len(taps)):
                cos[j].append(torch.nn.functional.cosine_similarity(x[:, j], y[:, j], dim=-1))
                d = (x[:, j] - y[:, j]).abs()
                maxabs[j] = max(maxabs[j], d.max().item())
                sumabs[j] += d.sum().item()
                same[j] += (sa.hidden[:, j].view(torch.int16) == sb.hidden[:, j].view(torch.int16)).sum().item()
    hidden = a.attrs.hidden_size
    rows = []
    for j, k in enumerate(taps):
        c = torch.cat(cos[j])
        rows.append({"tap": k, "cos_mean": c.mean().item(), "cos_min": c.min().item(), "max_abs": maxabs[j],
                     "mean_abs": sumabs[j] / (count * hidden), "bit_identical": same[j] / (count * hidden)})
    return {"a": a.location, "b": b.location, "a_backend": a.attrs.backends.linear_attention,
            "b_backend": b.attrs.backends.linear_attention, "shards": shards, "tokens": count, "taps": list(rows)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    r = compare(HiddenStore(args.a), HiddenStore(args.b))
    print(f"{r['a']} ({r['a_backend']}) vs {r['b']} ({r['b_backend']}): shards {r['shards']}, {r['tokens']} tokens\n")
    print("| tap | cos mean | cos min | max abs diff | mean abs diff | bit-identical |\n| --- | --- | --- | --- | --- | --- |")
    for t in r["taps"]:
        print(f"| {t['tap']} | {t['cos_mean']:.6f} | {t['cos_min']:.6f} | {t['max_abs']:.4g} | {t['mean_abs']:.3g} | "
              f"{t['bit_identical']:.1%} |")
    if args.json:
        args.json.write_text(json.dumps(r, indent=1))


if __name__ == "__main__":
    main()

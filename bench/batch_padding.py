"""Prompt tokens the target pads to, batching a shard's rows in dataset order vs by prompt length.

    python bench/batch_padding.py [--dataset pipeline/assets/prompts.jsonl] [--batch-size 16]

Generation and capture pad every batch to its longest row; extraction orders a shard's rows by
prompt length (`PromptSet.by_length`). Counts only (no model runs): prompt tokens, and prompt
tokens padded to each batch's longest, for several shard sizes.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.modules.setdefault("fla", None)

from transformers import AutoTokenizer  # noqa: E402

from pipeline import DEFAULT_PROMPTS, TINY_TARGET, prompts  # noqa: E402


def padded(lengths: list[int], batch: int) -> int:
    return sum(max(lengths[k:k + batch]) * len(lengths[k:k + batch]) for k in range(0, len(lengths), batch))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dataset", default=str(DEFAULT_PROMPTS))
    p.add_argument("--target", default=str(TINY_TARGET), help="whose tokenizer and chat template count tokens")
    p.add_argument("--batch-size", type=int, default=16)
    args = p.parse_args()
    tok = AutoTokenizer.from_pretrained(args.target)
    ps = prompts.load(args.dataset)
    text = [tok.apply_chat_template(list(ps.row(i).messages), add_generation_prompt=True, tokenize=False)
            for i in range(len(ps))]
    n_tokens = [len(tok(t, add_special_tokens=False).input_ids) for t in text]
    print("| shards | rows per shard | prompt tokens | padded, dataset order | padded, by length |")
    print("|---|---|---|---|---|")
    for shards in (64, 8, 4, 1):
        real = row = length = 0
        for s in range(shards):
            rows = list(ps.shard_rows(s, shards))
            real += sum(n_tokens[i] for i in rows)
            row += padded([n_tokens[i] for i in rows], args.batch_size)
            length += padded([n_tokens[r.index] for r in ps.by_length(rows)], args.batch_size)
        print(f"| {shards} | {len(ps) // shards} | {real} | {row} ({row / real:.2f}x) | {length} ({length / real:.2f}x) |")


if __name__ == "__main__":
    main()

"""Files and directories one shard of a 27B run's shape takes on a POSIX store (what per-user inode
quotas count), for several --shard-tokens (a measurement, not a test).

    python bench/inode_bench.py --like hs.zarr --shard-tokens 4096,16384 [--json bench/results/inodes.json]

Writes with the store's own ShardWriter one shard of 1,024 samples of 1,950 tokens (the issue's
27B job: 2.5M samples in 2,442 shards) at hidden width 8 (the count of files does not depend on
the width, only on the tokens), with --like's taps and embeddings, and counts what is under
`shards/00000` plus its commit file; then scales to 2,442 shards.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from pipeline import fingerprint  # noqa: E402
from store.hidden_store import HiddenStore  # noqa: E402
from store.schema import to_json  # noqa: E402
from store.shard_writer import ShardWriter  # noqa: E402
from store.store_writer import StoreWriter  # noqa: E402

SAMPLES, TOKENS, SHARDS = 1024, 1950, 2442


def count(like: str, shard_tokens: int, where: str) -> dict:
    src = HiddenStore(like)
    layout = dataclasses.replace(src.attrs.layout, shard_tokens=shard_tokens)
    compat = dataclasses.replace(src.attrs.compat, shard_tokens=shard_tokens)
    attrs = dataclasses.replace(src.attrs, layout=layout, compat=compat,
                                fingerprint=fingerprint.sha256_json(to_json(compat)))
    store = StoreWriter(where)
    store.create_or_check(attrs, src.embedding("embed_tokens"), src.embedding("lm_head"))
    n_taps = len(attrs.taps)
    w = ShardWriter(store, 0, n_taps, 8, chunk_tokens=attrs.layout.chunk_tokens, shard_tokens=shard_tokens)
    for i in range(SAMPLES):
        w.add(i, list(range(5, 155)), list(range(7, 7 + TOKENS - 150)), truncated=False)
    w.add_hidden(torch.randn(SAMPLES * TOKENS, n_taps, 8).to(torch.bfloat16))
    w.commit(None, run={})
    walked = list(os.walk(Path(where) / "shards" / "00000"))
    files, dirs = sum(len(f) for _, _, f in walked), len(walked)
    inodes = files + dirs + 1  # and its commit file
    return {"shard_tokens": shard_tokens, "files": files, "dirs": dirs, "inodes_per_shard": inodes,
            "inodes_at_2442_shards": inodes * SHARDS}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--like", required=True, help="a store whose root (taps, embeddings) the shard is written under")
    p.add_argument("--shard-tokens", default="4096,16384")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = [count(args.like, int(s), f"{tmp}/s{s}.zarr") for s in args.shard_tokens.split(",")]
    print(json.dumps(rows, indent=1))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()

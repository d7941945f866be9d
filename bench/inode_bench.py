"""Files and directories one shard of a 27B run's shape takes on a POSIX store (what per-user inode
quotas count), per chunk key separator and --shard-tokens, and what a sample read from local disk
costs in each (a measurement, not a test).

    python bench/inode_bench.py --like hs.zarr --shard-tokens 4096,16384 --separators /,. \\
        [--read-samples 24] [--json bench/results/inodes.json]

Counting: writes with the store's own ShardWriter one shard of 1,024 samples of 1,950 tokens (the
issue's 27B job: 2.5M samples in 2,442 shards) at hidden width 8 (the count of files does not depend
on the width, only on the tokens), with --like's taps and embeddings, and counts what is under
`shards/00000` plus its commit file, per array too; then scales to 2,442 shards. Separator "/" is
format revision 4's chunk keys (c/K/0/0, a directory per key level), "." revision 5's (c.K.0.0).

Reading (--read-samples N > 0): per option, a shard of N samples of ~1,950 tokens at 27B width
(5 taps of 5,120, random bf16) written the same way, then every sample read once in a random order
through ShardReader (the direct span reads training uses), in passes (a new reader each: its
metadata and shard indexes read again), one thread, the options read in turn in each of 5 passes;
the median seconds a sample. The files are in
the page cache (just written): this is the reader's own cost, the disk's aside.

Writing (--write-tokens N > 0): per --shard-tokens, in a fresh process, ShardWriter (2 encoding
threads, its default 4 GiB bound) takes N tokens of 27B-width states (5 taps of 5,120, random
bf16) in batches of 2,048 (a new tensor each, handed over as fast as it takes them): seconds, raw
MB/s, and the process's peak resident memory over its size before the writer started.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from pipeline import fingerprint  # noqa: E402
from store import layout, shard_writer  # noqa: E402
from store.hidden_store import HiddenStore  # noqa: E402
from store.schema import to_json  # noqa: E402
from store.shard_reader import ShardReader  # noqa: E402
from store.shard_writer import ShardWriter  # noqa: E402
from store.store_writer import StoreWriter  # noqa: E402

SAMPLES, TOKENS, SHARDS = 1024, 1950, 2442
READ_TAPS, READ_WIDTH = 5, 5120


def new_store(like: str, shard_tokens: int, where: str) -> StoreWriter:
    src = HiddenStore(like)
    layout_rec = dataclasses.replace(src.attrs.layout, shard_tokens=shard_tokens)
    compat = dataclasses.replace(src.attrs.compat, shard_tokens=shard_tokens)
    attrs = dataclasses.replace(src.attrs, layout=layout_rec, compat=compat,
                                fingerprint=fingerprint.sha256_json(to_json(compat)))
    store = StoreWriter(where)
    store.create_or_check(attrs, src.embedding("embed_tokens"), src.embedding("lm_head"))
    return store


def write_shard(store: StoreWriter, shard_tokens: int, separator: str, samples: int, taps: int, width: int,
                seed: int = 0) -> None:
    """One shard of `samples` samples (~TOKENS each) written by ShardWriter with chunk keys `separator`."""
    shard_writer._KEYS = layout.chunk_key_encoding(separator)  # the writer's keys, revision 4's or 5's
    w = ShardWriter(store, 0, taps, width, chunk_tokens=store.attrs.layout.chunk_tokens, shard_tokens=shard_tokens)
    g = torch.Generator().manual_seed(seed)
    for i in range(samples):
        n = TOKENS if width == 8 else TOKENS + int(torch.randint(-200, 200, (1,), generator=g))
        w.add(i, list(range(5, 155)), list(range(7, 7 + n - 150)), truncated=False)
        if width != 8:  # wide states: a batch a sample (bounded memory)
            w.add_hidden(torch.randn(n, taps, width, generator=g).to(torch.bfloat16))
    if width == 8:
        w.add_hidden(torch.randn(samples * TOKENS, taps, width, generator=g).to(torch.bfloat16))
    w.commit(None, run={})


def count(like: str, shard_tokens: int, separator: str, where: str) -> dict:
    store = new_store(like, shard_tokens, where)
    write_shard(store, shard_tokens, separator, SAMPLES, len(store.attrs.taps), 8)
    shard = Path(where) / "shards" / "00000"
    walked = list(os.walk(shard))
    files, dirs = sum(len(f) for _, _, f in walked), len(walked)
    per_array = {a.name: sum(len(f) for _, _, f in os.walk(a)) for a in sorted(shard.iterdir()) if a.is_dir()}
    inodes = files + dirs + 1  # and its commit file
    return {"separator": separator, "shard_tokens": shard_tokens, "files": files, "dirs": dirs,
            "inodes_per_shard": inodes, "inodes_at_2442_shards": inodes * SHARDS, "files_per_array": per_array}


def read_costs(stores: list[str], passes: int = 5) -> list[float]:
    """Per store, the median seconds a sample; the stores read in turn each pass (a busy machine
    slows them alike), every sample once a pass in a random order, with a new reader."""
    rng = np.random.default_rng(0)
    times: list[list[float]] = [[] for _ in stores]
    for _ in range(passes):
        for k, where in enumerate(stores):
            reader = ShardReader(HiddenStore(where), 0)
            for i in rng.permutation(len(reader)):
                t = time.perf_counter()
                reader.read(int(i))
                times[k].append(time.perf_counter() - t)
    return [round(statistics.median(t), 5) for t in times]


def write_cost(like: str, shard_tokens: int, where: str, tokens: int) -> dict:
    """Run in a fresh process: ShardWriter's seconds and peak memory for `tokens` tokens at 27B width."""
    store = new_store(like, shard_tokens, where)
    g = torch.Generator().manual_seed(0)
    base = torch.randn(2048, READ_TAPS, READ_WIDTH, generator=g).to(torch.bfloat16)
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = time.perf_counter()
    w = ShardWriter(store, 0, READ_TAPS, READ_WIDTH, chunk_tokens=store.attrs.layout.chunk_tokens,
                    shard_tokens=shard_tokens, threads=2)
    for i in range(tokens // 2048):
        w.add(i, [5] * 48, [7] * 2000, truncated=False)
        w.add_hidden(base.clone())
    w.commit(None, run={})
    s = time.perf_counter() - t
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss0  # KiB
    raw = tokens * READ_TAPS * READ_WIDTH * 2
    return {"write_tokens": tokens, "write_s": round(s, 2), "write_raw_mb_per_s": round(raw / s / 1e6, 1),
            "write_peak_rss_growth_mb": round(peak * 1024 / 1e6), "state_file_raw_mb": round(
                shard_tokens * READ_TAPS * READ_WIDTH * 2 / 1e6)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--like", required=True, help="a store whose root (taps, embeddings) the shard is written under")
    p.add_argument("--shard-tokens", default="4096,16384")
    p.add_argument("--separators", default="/,.", help="chunk key separators: / (revision 4), . (revision 5)")
    p.add_argument("--read-samples", type=int, default=0, help="samples of the 27B-width read shard (0: no reads)")
    p.add_argument("--write-tokens", type=int, default=0, help="tokens of the 27B-width write measured (0: none)")
    p.add_argument("--json", type=Path)
    p.add_argument("--child-write", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child_write:  # one write measured in this fresh process
        print(json.dumps(write_cost(args.like, int(args.shard_tokens), args.child_write, args.write_tokens)))
        return
    torch.set_num_threads(1)
    rows, reads = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for s in map(int, args.shard_tokens.split(",")):
            for sep in args.separators.split(","):
                tag = f"s{s}{'dot' if sep == '.' else 'slash'}"
                rows.append(count(args.like, s, sep, f"{tmp}/{tag}.zarr"))
                print(json.dumps(rows[-1]), flush=True)
                if args.read_samples:
                    reads.append(f"{tmp}/{tag}_read.zarr")
                    write_shard(new_store(args.like, s, reads[-1]), s, sep, args.read_samples, READ_TAPS, READ_WIDTH)
        for row, median in zip(rows, read_costs(reads) if reads else []):
            row.update({"read_samples": args.read_samples, "read_taps": READ_TAPS, "read_width": READ_WIDTH,
                        "local_s_per_sample_median": median})
        for row in rows if args.write_tokens else []:
            tag = f"{tmp}/w{row['shard_tokens']}{'dot' if row['separator'] == '.' else 'slash'}.zarr"
            child = subprocess.run([sys.executable, __file__, "--like", args.like, "--shard-tokens",
                                    str(row["shard_tokens"]), "--write-tokens", str(args.write_tokens),
                                    "--child-write", tag], capture_output=True, text=True, check=True)
            row.update(json.loads(child.stdout.strip().splitlines()[-1]))
            print(json.dumps(row), flush=True)
    print(json.dumps(rows, indent=1))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()

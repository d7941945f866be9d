"""Training's start-up at the real job's shard count: seconds from the store opened to the first
step's batch ready, on each rank, for a store of thousands of tiny shards.

    python bench/startup_bench.py build --store /tmp/s2442.zarr --like hs.zarr --shards 2442
    python bench/startup_bench.py time --store /tmp/s2442.zarr --ranks 1,2 [--json out.json]

`build` writes a store with the root (attributes, embeddings) of --like, its shard count set to
--shards, and every shard a few tiny samples of random states (the sample index and the commit
files, not the states, are what start-up reads). `time` runs in fresh processes (torchrun with
gloo for --ranks > 1) train.py's setup (`stages.train.setup.prepare`: store, commit files, sample
index of --shards and --eval-shards, DDP) and then the first batch of the loader, and reports per
rank the seconds of each (imports not counted). An fsspec URL works as --store (s3://...,
with FSSPEC_S3_ENDPOINT_URL for a local server).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
SAMPLES, TOKENS = 4, 48  # per shard: tiny, so the build takes about a minute


def build(location: str, like: str, shards: int) -> None:
    import torch
    from tqdm import tqdm

    from pipeline import fingerprint
    from store.hidden_store import HiddenStore
    from store.schema import to_json
    from store.shard_writer import ShardWriter
    from store.store_writer import StoreWriter

    src = HiddenStore(like)
    compat = dataclasses.replace(src.attrs.compat, num_shards=shards)
    attrs = dataclasses.replace(src.attrs, num_shards=shards, compat=compat,
                                fingerprint=fingerprint.sha256_json(to_json(compat)))
    store = StoreWriter(location)
    store.create_or_check(attrs, src.embedding("embed_tokens"), src.embedding("lm_head"))
    g = torch.Generator().manual_seed(0)
    n_taps, width = len(attrs.taps), attrs.hidden_size
    for shard in tqdm(range(shards), unit="shard", desc="build"):
        if store.commit_record(shard) is not None:
            continue
        w = ShardWriter(store, shard, n_taps, width, chunk_tokens=attrs.layout.chunk_tokens,
                        shard_tokens=attrs.layout.shard_tokens)
        for i in range(SAMPLES):
            w.add(shard * SAMPLES + i, list(range(5, 5 + TOKENS // 2)), list(range(7, 7 + TOKENS // 2)), truncated=False)
        w.add_hidden(torch.randn(SAMPLES * TOKENS, n_taps, width, generator=g).to(torch.bfloat16))
        w.commit(None, run={})


CHILD = """
import json, sys, time
sys.path.insert(0, {root!r})
t0 = time.perf_counter()
from stages.train.config import TrainConfig
from stages.train.data import loader, train_batches
from stages.train.setup import prepare
imports = time.perf_counter() - t0
config = TrainConfig(store={store!r}, out={out!r}, eval_shards={eval_shards!r}, workers=1, batch_size=2,
                     max_steps=1, threads=1)
t = time.perf_counter()
s = prepare(config, log=lambda m: None)
setup = time.perf_counter() - t
acc = s.accelerator
mine = train_batches(config, s.train_refs, 0, acc.process_index, acc.num_processes)
t = time.perf_counter()
next(iter(loader(config, mine, False, set())))
first = time.perf_counter() - t
print("RESULT", json.dumps({{"rank": acc.process_index, "ranks": acc.num_processes, "imports_s": round(imports, 2),
                            "setup_s": round(setup, 2), "first_batch_s": round(first, 2),
                            "samples": len(s.train_refs) + len(s.eval_refs)}}))
"""


def time_ranks(location: str, ranks: int, eval_shards: str) -> list[dict]:
    with tempfile.TemporaryDirectory() as out:
        code = CHILD.format(root=str(ROOT), store=location, out=out, eval_shards=eval_shards)
        script = Path(out) / "child.py"
        script.write_text(code)
        cmd = [sys.executable, str(script)] if ranks == 1 else [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks), str(script)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true"}
        p = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if p.returncode:
            raise SystemExit(p.stderr[-3000:])
    return sorted((json.loads(line.split(" ", 1)[1]) for line in p.stdout.splitlines() if line.startswith("RESULT")),
                  key=lambda r: r["rank"])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("--store", required=True)
    b.add_argument("--like", required=True)
    b.add_argument("--shards", type=int, default=2442)
    t = sub.add_parser("time")
    t.add_argument("--store", required=True)
    t.add_argument("--ranks", default="1,2")
    t.add_argument("--eval-shards", default="2400-2441")
    t.add_argument("--json", type=Path)
    args = p.parse_args()
    if args.cmd == "build":
        t0 = time.time()
        build(args.store, args.like, args.shards)
        print(f"built {args.store}: {args.shards} shards in {time.time() - t0:.0f}s")
        return
    rows = [r for n in map(int, args.ranks.split(",")) for r in time_ranks(args.store, n, args.eval_shards)]
    print("| ranks | rank | setup s | first batch s | samples |\n|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['ranks']} | {r['rank']} | {r['setup_s']} | {r['first_batch_s']} | {r['samples']} |")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")


if __name__ == "__main__":
    main()

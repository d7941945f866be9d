"""Training's start-up at the real job's shard count: seconds from the store opened to the first
step's batch ready, on each rank, for a store of thousands of tiny shards.

    python bench/startup_bench.py build --store /tmp/s2442.zarr --like hs.zarr --shards 2442
    python bench/startup_bench.py time --store /tmp/s2442.zarr --ranks 1,2 [--json out.json]
    python bench/startup_bench.py samples --samples 2500000 [--code DIR] [--json out.json]
    python bench/startup_bench.py samples --data-order node --local 8 --shuffle-window 64 --json out.json

`build` writes a store with the root (attributes, embeddings) of --like, its shard count set to
--shards, and every shard a few tiny samples of random states (the sample index and the commit
files, not the states, are what start-up reads). `time` runs in fresh processes (torchrun with
gloo for --ranks > 1) train.py's setup (`stages.train.setup.prepare`: store, commit files, sample
index of --shards and --eval-shards, DDP) and then the first batch of the loader, and reports per
rank the seconds of each (imports not counted). An fsspec URL works as --store (s3://...,
with FSSPEC_S3_ENDPOINT_URL for a local server).

`samples` times, on one rank of --world, the start-up work that grows with the sample count, from
the per-sample arrays the main process hands every rank (store/index_file.py's StoreIndex.arrays,
synthetic: --samples over 2,442 shards, ~2k tokens each): receiving them (unpickling, as
broadcast_object_list does), the sample refs (stages/train/data.refs_of), the shared-memory check,
epoch 0's length, the rank's batches of the epoch and its first batch; for a launch resumed in
epoch 3 the same from the saved position; and the position a save 3.5 epochs into a run walks to
(stages/train/position.advance, the main process only), for each --batching (and --data-order:
node forms the node-affine order of --world / --local nodes, windows of --shuffle-window shards).
Then, in a second
pass with tracemalloc, the bytes the rank holds after start-up (refs and its batches) and the peak.
--code DIR measures the stages/ of another checkout (an older commit) with the same script.
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


SAMPLES_CHILD = """
import json, math, pickle, sys, time, tracemalloc
sys.path.insert(0, {code!r})
import numpy as np
from stages.train.config import TrainConfig
from stages.train.data import epoch_length, refs_of, shared_memory_need
from stages.train.position import Position, advance, rank_batches

SHARDS, EVAL = 2442, 42  # the last EVAL shards held out
rng = np.random.default_rng(0)
per = math.ceil({samples} / SHARDS)
arrays = {{}}
for s in range(SHARDS):  # lengths ~2k tokens (64-4,095), a first loss pair early, 1% of samples without one
    lengths = rng.integers(64, 4096, per)
    first = np.where(rng.random(per) < 0.01, -1, rng.integers(0, 64, per)).astype(np.int32)
    arrays[s] = {{"offsets": np.concatenate([[0], np.cumsum(lengths)]), "first_pairs": first}}
sent = pickle.dumps(arrays, protocol=pickle.HIGHEST_PROTOCOL)
ORDER = {order!r}  # --data-order; node: {local} processes a node, windows of --shuffle-window shards
config = TrainConfig(batching={batching!r}, max_length=4096, batch_size=1,
                     **(dict(data_order="node", shuffle_window={window}) if ORDER == "node" else {{}}))
world, rank = {world}, {world} // 2
LOCAL = ({local},) if ORDER == "node" else ()  # the node order's extra argument (older checkouts have none)
LAYOUT = ((world // {local}, {local}),) if ORDER == "node" else ()
train_ids, eval_ids = list(range(SHARDS - EVAL)), list(range(SHARDS - EVAL, SHARDS))


def launch(position):
    got = pickle.loads(sent)
    train, held = refs_of(got, train_ids, config.max_length), refs_of(got, eval_ids, config.max_length)
    shared_memory_need(config, train + held, 5, 5120, 8)
    micro = epoch_length(config, train, 0, *LAYOUT) // world
    mine = rank_batches(config, train, position, position.epoch, rank, world, *LOCAL)
    first = mine[0]
    return train, held, micro, mine, first


def timed(fn, *a):
    t = time.perf_counter()
    out = fn(*a)
    return out, round(time.perf_counter() - t, 2)


def steps(position):
    t = {{}}
    got, t["receive_s"] = timed(pickle.loads, sent)
    (train, held), t["refs_s"] = timed(lambda: (refs_of(got, train_ids, config.max_length),
                                                 refs_of(got, eval_ids, config.max_length)))
    _, t["shm_check_s"] = timed(shared_memory_need, config, train + held, 5, 5120, 8)
    micro, t["epoch_length_s"] = timed(lambda: epoch_length(config, train, 0, *LAYOUT) // world)
    mine, t["rank_batches_s"] = timed(rank_batches, config, train, position, position.epoch, rank, world, *LOCAL)
    _, t["first_batch_s"] = timed(lambda: mine[0])
    t["total_s"] = round(sum(t.values()), 2)
    return t, train, micro


fresh, train, micro = steps(Position())
epoch_s = sorted(timed(rank_batches, config, train, Position(), e, rank, world, *LOCAL)[1] for e in (1, 2, 3))[1]
at, save_s = timed(advance, config, train, Position(), int(3.5 * micro), world, *LOCAL)  # epochs 0-3 formed by the run
cold = refs_of(pickle.loads(sent), train_ids, config.max_length)
_, walk_s = timed(advance, config, cold, Position(), int(3.5 * micro), world, *LOCAL)  # none formed: a resume without position
resumed, _, _ = steps(Position.from_json(json.loads(json.dumps(at.to_json()))))
del train, cold
tracemalloc.start()
held = launch(Position())
now, peak = tracemalloc.get_traced_memory()
print("RESULT", json.dumps({{"batching": {batching!r}, "order": ORDER, "samples": per * SHARDS, "world": world, "rank": rank,
                            "launch": fresh, "resumed_launch_epoch_3": resumed, "next_epoch_s": epoch_s,
                            "save_after_3_5_epochs_s": save_s, "walk_3_5_epochs_cold_s": walk_s,
                            "held_mb": round(now / 1e6, 1), "peak_mb": round(peak / 1e6, 1),
                            "index_pickle_mb": round(len(sent) / 1e6, 1)}}))
"""


def time_samples(samples: int, world: int, batching: str, code: Path, order: str = "global", local: int = 8,
                 window: int = 64) -> dict:
    script = SAMPLES_CHILD.format(code=str(code), samples=samples, world=world, batching=batching, order=order,
                                  local=local, window=window)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    if p.returncode:
        raise SystemExit(p.stderr[-3000:])
    return next(json.loads(line.split(" ", 1)[1]) for line in p.stdout.splitlines() if line.startswith("RESULT"))


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
    m = sub.add_parser("samples")
    m.add_argument("--samples", type=int, default=2_500_000)
    m.add_argument("--world", type=int, default=32)
    m.add_argument("--batching", default="random,bucketed,packed")
    m.add_argument("--code", type=Path, default=ROOT, help="the checkout whose stages/ are measured")
    m.add_argument("--data-order", default="global", help="global, node, or both: global,node")
    m.add_argument("--local", type=int, default=8, help="--data-order node: processes a node (--world / this: nodes)")
    m.add_argument("--shuffle-window", type=int, default=64, help="--data-order node: shards a window")
    m.add_argument("--json", type=Path)
    args = p.parse_args()
    if args.cmd == "samples":
        rows = [time_samples(args.samples, args.world, b, args.code, o, args.local, args.shuffle_window)
                for o in args.data_order.split(",") for b in args.batching.split(",")]
        print("| order | batching | launch s | resumed launch s | next epoch s | save s | cold walk s | held MB | peak MB |\n"
              "|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r.get('order', 'global')} | {r['batching']} | {r['launch']['total_s']} | {r['resumed_launch_epoch_3']['total_s']} | "
                  f"{r['next_epoch_s']} | {r['save_after_3_5_epochs_s']} | {r['walk_3_5_epochs_cold_s']} | "
                  f"{r['held_mb']} | {r['peak_mb']} |")
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1) + "\n")
        return
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

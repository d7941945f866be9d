"""Training's reads against the store's size: a loader worker's memory (`worker`), and start-up at
the real job's shard count (`startup build`, `startup time`, `startup samples`).

    python -m bench.read_bench worker --like hs.zarr --shards 8,64 [--json bench/results/reader_cpu.json]
    python -m bench.read_bench startup build --store /tmp/s2442.zarr --like hs.zarr --shards 2442
    python -m bench.read_bench startup time --store /tmp/s2442.zarr --ranks 1,2 [--json out.json]
    python -m bench.read_bench startup samples --samples 2500000 [--code DIR] [--json out.json]
    python -m bench.read_bench startup samples --data-order node --local 8 --shuffle-window 64 --json out.json

`worker` writes synthetic stores (random bf16 states of one 8-wide tap: the per-token arrays, not
the states, are what grows with the store here) of 8 and 64 shards on the root of --like (its
attributes at that width, zero embeddings), each shard 400 samples of 1,000
tokens, then in a fresh process per store builds the training index (`index_samples`, timed, and
its peak resident memory over the process's start), and in another fresh process reads 300 random
batches of 8 samples spread over every shard the way a DataLoader worker does (`StoreBatches`),
reporting that process's peak resident memory over its start (harness.in_child). A reader that kept
whole per-token arrays would grow with the shard count.

`startup build` writes a store with the root (attributes, embeddings) of --like, its shard count set
to --shards, and every shard a few tiny samples of random states (the sample index and the commit
files, not the states, are what start-up reads). `startup time` runs in fresh processes (torchrun
with gloo for --ranks > 1) train.py's setup (`stages.train.setup.prepare`: store, commit files,
sample index of --shards and --eval-shards, DDP) and then the first batch of the loader, and reports
per rank the seconds of each (imports not counted). An fsspec URL works as --store (s3://..., with
FSSPEC_S3_ENDPOINT_URL for a local server).

`startup samples` times, on one rank of --world, the start-up work that grows with the sample count,
from the per-sample arrays the main process hands every rank (store/index_file.py's
StoreIndex.arrays, synthetic: --samples over 2,442 shards, ~2k tokens each): receiving them
(unpickling, as broadcast_object_list does), the sample refs (stages/train/samples.refs_of), the
shared-memory check, epoch 0's length, the rank's batches of the epoch and its first batch; for a
launch resumed in epoch 3 the same from the saved position; and the position a save 3.5 epochs into
a run walks to (stages/train/position.advance, the main process only), for each --batching (and
--data-order: node forms the node-affine order of --world / --local nodes, windows of
--shuffle-window shards). Then, in a second pass with tracemalloc, the bytes the rank holds after
start-up (refs and its batches) and the peak. --code DIR measures the stages/ of another checkout
(an older commit) with the same script. Each start-up step is one timed call (a start-up happens
once). --toy: `worker` writes 40 samples a shard and reads 30 batches; the rest take their sizes from
the flags (TOY).
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

from bench import harness

# at module level, so a measured child's start (harness.in_child) includes these imports
from stages.train.dataset import StoreBatches
from stages.train.samples import index_samples
from store.hidden_store import HiddenStore

TOY = [
    ["worker", "--shards", "2,4", "--like", "{store}"],
    ["startup", "build", "--store", "{tmp}/s.zarr", "--like", "{store}", "--shards", "12"],
    ["startup", "time", "--store", "{store}", "--ranks", "1", "--eval-shards", "3"],
    ["startup", "samples", "--samples", "5000", "--batching", "random,packed", "--data-order", "global,node"],
]
SAMPLES, TOKENS, TAPS, WIDTH = 400, 1000, 1, 8  # worker: per shard
TINY_SAMPLES, TINY_TOKENS = 4, 48  # startup build: per shard, tiny, so the build takes about a minute


def build_worker_store(path: Path, like: str, shards: int, samples: int) -> None:
    import numpy as np
    import torch

    from bench.store_bench import root_of
    from store.shard_writer import ShardWriter
    from store.store_writer import StoreWriter

    path.mkdir(parents=True)
    root_of(like, path, np.empty((0, TAPS, WIDTH), np.uint16), "bf16")
    store = StoreWriter(str(path))
    g = torch.Generator().manual_seed(0)
    for shard in range(shards):
        writer = ShardWriter(store, shard, TAPS, WIDTH, chunk_tokens=4096, shard_tokens=65536)
        for i in range(samples):
            prompt = list(range(TOKENS // 4))
            writer.add(i, prompt, list(range(TOKENS - len(prompt))), truncated=False)
        writer.add_hidden(torch.randn(samples * TOKENS, TAPS, WIDTH, generator=g).to(torch.bfloat16))
        writer.commit(None, run={})


def index_of(path: str, shards: int) -> dict:
    """Run in a fresh process: the training index's time, and the refs."""
    held = {}
    t = harness.medians(lambda: held.update(refs=index_samples(HiddenStore(path), list(range(shards)), 4096)), 1)
    return {"index_s": round(t["median_s"], 3), "refs": held["refs"]}


def worker_reads(path: str, batches: list) -> dict:
    """Run in a fresh process: a loader worker's reads of the batches."""
    data = StoreBatches(path, batches)

    def read_all():
        for i in range(len(batches)):
            data[i]  # read and dropped, as a worker hands each batch on

    t = harness.medians(read_all, 1)
    return {"batches_per_s": round(len(batches) / t["median_s"], 1)}


def growth_mb(memory: dict) -> float:
    return round((memory["peak_rss_bytes"] - memory["start_rss_bytes"]) / 2**20, 1)


def run_worker(args) -> dict:
    import numpy as np

    samples, n_batches = (40, 30) if args.toy else (SAMPLES, 300)
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in map(int, args.shards.split(",")):
            path = Path(tmp) / f"s{n}.zarr"
            build_worker_store(path, args.like, n, samples)
            index, index_mem = harness.in_child(index_of, str(path), n)
            refs = index.pop("refs")
            rng = np.random.default_rng(0)
            batches = [[(refs[k],) for k in rng.integers(0, len(refs), 8)] for _ in range(n_batches)]
            reads, worker_mem = harness.in_child(worker_reads, str(path), batches)
            results.append(
                {
                    "shards": n,
                    "samples": len(refs),
                    **index,
                    "index_rss_growth_mb": growth_mb(index_mem),
                    "worker_rss_growth_mb": growth_mb(worker_mem),
                    **reads,
                }
            )
            print(results[-1], file=sys.stderr)
    return {"samples_per_shard": samples, "tokens_per_sample": TOKENS, "results": results}


def build(location: str, like: str, shards: int) -> None:
    """A store of `shards` tiny shards on the root of --like."""
    import torch
    from tqdm import tqdm

    from pipeline import fingerprint
    from store.format.schema import to_json
    from store.shard_writer import ShardWriter
    from store.store_writer import StoreWriter

    src = HiddenStore(like)
    compat = dataclasses.replace(src.attrs.compat, num_shards=shards)
    attrs = dataclasses.replace(
        src.attrs, num_shards=shards, compat=compat, fingerprint=fingerprint.sha256_json(to_json(compat))
    )
    store = StoreWriter(location)
    store.create_or_check(attrs, src.embedding("embed_tokens"), src.embedding("lm_head"))
    g = torch.Generator().manual_seed(0)
    n_taps, width = len(attrs.taps), attrs.hidden_size
    for shard in tqdm(range(shards), unit="shard", desc="build"):
        if store.commit_record(shard) is not None:
            continue
        w = ShardWriter(
            store, shard, n_taps, width, chunk_tokens=attrs.layout.chunk_tokens, shard_tokens=attrs.layout.shard_tokens
        )
        for i in range(TINY_SAMPLES):
            w.add(
                shard * TINY_SAMPLES + i,
                list(range(5, 5 + TINY_TOKENS // 2)),
                list(range(7, 7 + TINY_TOKENS // 2)),
                truncated=False,
            )
        w.add_hidden(torch.randn(TINY_SAMPLES * TINY_TOKENS, n_taps, width, generator=g).to(torch.bfloat16))
        w.commit(None, run={})


def time_child(store: str, out: str, eval_shards: str) -> None:
    """One rank of `startup time` (under torchrun for more): setup's and the first batch's seconds."""
    t0 = time.perf_counter()
    from stages.train.config import TrainConfig
    from stages.train.epoch_order import train_batches
    from stages.train.loader import loader
    from stages.train.setup import prepare

    imports = time.perf_counter() - t0
    config = TrainConfig.of(
        store=store, out=out, eval_shards=eval_shards, workers=1, batch_size=2, max_steps=1, threads=1
    )
    t = time.perf_counter()
    s = prepare(config, log=lambda m: None)
    setup = time.perf_counter() - t
    acc = s.accelerator
    mine = train_batches(config.data, s.train_refs, 0, acc.process_index, acc.num_processes)
    t = time.perf_counter()
    next(iter(loader(config.data, mine, False, set(), store=s.store, node_cache=s.node_cache)))
    first = time.perf_counter() - t
    print(
        "RESULT",
        json.dumps(
            {
                "rank": acc.process_index,
                "ranks": acc.num_processes,
                "imports_s": round(imports, 2),
                "setup_s": round(setup, 2),
                "first_batch_s": round(first, 2),
                "samples": len(s.train_refs) + len(s.eval_refs),
            }
        ),
    )


def results_of(p: subprocess.CompletedProcess) -> list[dict]:
    """The RESULT lines a child printed (its error if it failed)."""
    if p.returncode:
        raise SystemExit(p.stderr[-3000:])
    return [json.loads(line.split(" ", 1)[1]) for line in p.stdout.splitlines() if line.startswith("RESULT")]


def time_ranks(location: str, ranks: int, eval_shards: str) -> list[dict]:
    """`startup time` on `ranks` fresh processes: each rank's figures."""
    with tempfile.TemporaryDirectory() as out:
        child = [
            "-m",
            "bench.read_bench",
            "startup",
            "child",
            "--store",
            location,
            "--out",
            out,
            "--eval-shards",
            eval_shards,
        ]
        launcher = [] if ranks == 1 else ["-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "ACCELERATE_USE_CPU": "true"}
        p = subprocess.run(harness.python(*launcher, *child), capture_output=True, text=True, env=env, cwd=harness.REPO)
    return sorted(results_of(p), key=lambda r: r["rank"])


SAMPLES_CHILD = """
import json, math, pickle, time, tracemalloc
import numpy as np
from stages.train.config import TrainConfig
from stages.train.epoch_order import epoch_length
from stages.train.loader import shared_memory_need
from stages.train.position import Position, advance, rank_batches
from stages.train.samples import refs_of

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
settings = dict(batching={batching!r}, max_length=4096, batch_size=1,
                **(dict(data_order="node", shuffle_window={window}) if ORDER == "node" else {{}}))
# the data settings (config.data since TrainConfig is composed of component configs; older checkouts: flat)
config = getattr(TrainConfig, "of", TrainConfig)(**settings)
config = getattr(config, "data", config)
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
# epochs 0-3 formed by the run
at, save_s = timed(advance, config, train, Position(), int(3.5 * micro), world, *LOCAL)
cold = refs_of(pickle.loads(sent), train_ids, config.max_length)
# none formed: a resume without position
_, walk_s = timed(advance, config, cold, Position(), int(3.5 * micro), world, *LOCAL)
resumed, _, _ = steps(Position.from_json(json.loads(json.dumps(at.to_json()))))
del train, cold
tracemalloc.start()
held = launch(Position())
now, peak = tracemalloc.get_traced_memory()
print("RESULT", json.dumps({{"batching": {batching!r}, "order": ORDER, "samples": per * SHARDS,
                            "world": world, "rank": rank, "launch": fresh, "resumed_launch_epoch_3": resumed,
                            "next_epoch_s": epoch_s,
                            "save_after_3_5_epochs_s": save_s, "walk_3_5_epochs_cold_s": walk_s,
                            "held_mb": round(now / 1e6, 1), "peak_mb": round(peak / 1e6, 1),
                            "index_pickle_mb": round(len(sent) / 1e6, 1)}}))
"""


def time_samples(
    samples: int, world: int, batching: str, code: Path, order: str = "global", local: int = 8, window: int = 64
) -> dict:
    """SAMPLES_CHILD run on the code of the checkout `code` (its stages/, through PYTHONPATH)."""
    script = SAMPLES_CHILD.format(
        samples=samples, world=world, batching=batching, order=order, local=local, window=window
    )
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(code)}
    return results_of(subprocess.run(harness.python("-c", script), capture_output=True, text=True, env=env, cwd=code))[
        0
    ]


def table(header: list[str], rows: list[list]) -> str:
    return "\n".join(
        [
            "| " + " | ".join(header) + " |",
            "|" + "---|" * len(header),
            *("| " + " | ".join(map(str, r)) + " |" for r in rows),
        ]
    )


def run_samples(args) -> list[dict]:
    rows = [
        time_samples(args.samples, args.world, b, args.code, o, args.local, args.shuffle_window)
        for o in args.data_order.split(",")
        for b in args.batching.split(",")
    ]
    print(
        table(
            [
                "order",
                "batching",
                "launch s",
                "resumed launch s",
                "next epoch s",
                "save s",
                "cold walk s",
                "held MB",
                "peak MB",
            ],
            [
                [
                    r.get("order", "global"),
                    r["batching"],
                    r["launch"]["total_s"],
                    r["resumed_launch_epoch_3"]["total_s"],
                    r["next_epoch_s"],
                    r["save_after_3_5_epochs_s"],
                    r["walk_3_5_epochs_cold_s"],
                    r["held_mb"],
                    r["peak_mb"],
                ]
                for r in rows
            ],
        ),
        file=sys.stderr,
    )
    return rows


def run_time(args) -> list[dict]:
    rows = [r for n in map(int, args.ranks.split(",")) for r in time_ranks(args.store, n, args.eval_shards)]
    print(
        table(
            ["ranks", "rank", "setup s", "first batch s", "samples"],
            [[r["ranks"], r["rank"], r["setup_s"], r["first_batch_s"], r["samples"]] for r in rows],
        ),
        file=sys.stderr,
    )
    return rows


def run_build(args) -> dict:
    t0 = time.time()
    build(args.store, args.like, args.shards)
    return {"built": args.store, "shards": args.shards, "seconds": round(time.time() - t0)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    w = harness.subcommand(
        sub, "worker", "a loader worker's memory and the training index's time against the shard count"
    )
    w.add_argument("--shards", default="8,64")
    w.add_argument("--like", required=True, help="a store whose root the synthetic shards are written under")
    startup = sub.add_parser("startup", help="training's start-up at the real job's shard count").add_subparsers(
        dest="step", required=True
    )
    b = harness.subcommand(startup, "build", "a store of thousands of tiny shards")
    b.add_argument("--store", required=True)
    b.add_argument("--like", required=True)
    b.add_argument("--shards", type=int, default=2442)
    t = harness.subcommand(startup, "time", "train.py's setup and first batch, per rank")
    t.add_argument("--store", required=True)
    t.add_argument("--ranks", default="1,2")
    t.add_argument("--eval-shards", default="2400-2441")
    c = startup.add_parser("child")  # internal: one rank of `time`
    c.add_argument("--store", required=True)
    c.add_argument("--out", required=True)
    c.add_argument("--eval-shards", required=True)
    m = harness.subcommand(startup, "samples", "the start-up work that grows with the sample count, on one rank")
    m.add_argument("--samples", type=int, default=2_500_000)
    m.add_argument("--world", type=int, default=32)
    m.add_argument("--batching", default="random,bucketed,packed")
    m.add_argument("--code", type=Path, default=harness.REPO, help="the checkout whose stages/ are measured")
    m.add_argument("--data-order", default="global", help="global, node, or both: global,node")
    m.add_argument("--local", type=int, default=8, help="--data-order node: processes a node (--world / this: nodes)")
    m.add_argument("--shuffle-window", type=int, default=64, help="--data-order node: shards a window")
    args = harness.parse(p)
    if args.cmd == "startup" and args.step == "child":
        time_child(args.store, args.out, args.eval_shards)
        return
    harness.torch_setup(args.threads)
    run = (
        run_worker
        if args.cmd == "worker"
        else {"build": run_build, "time": run_time, "samples": run_samples}[args.step]
    )
    harness.emit(run(args), args)


if __name__ == "__main__":
    main()

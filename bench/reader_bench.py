"""A loader worker's memory and the training index's start-up time against the store's size.

    python bench/reader_bench.py --shards 8,64 [--json bench/results/reader_cpu.json]

Writes synthetic stores (random bf16 states of one 8-wide tap: the per-token arrays, not the
states, are what grows with the store here) of 8 and 64 shards, each shard 400 samples of 1,000
tokens, then in a fresh process per store: builds the training index (`index_samples`, timed,
and how much the process's resident memory grew) and reads 300 random batches of 8 samples spread
over every shard the way a DataLoader worker does (`StoreBatches`), reporting the largest growth
of the worker's resident memory over its start. A reader that kept whole per-token arrays would grow with the shard count.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.report import emit  # noqa: E402

SAMPLES, TOKENS, TAPS, WIDTH = 400, 1000, 1, 8


def build(path: Path, shards: int) -> None:
    import numpy as np
    import torch

    from store import layout
    from store.shard_writer import ShardWriter
    from store.store_writer import StoreWriter

    store = StoreWriter(str(path))
    path.mkdir(parents=True)
    g = torch.Generator().manual_seed(0)
    for shard in range(shards):
        writer = ShardWriter(store, shard, TAPS, WIDTH, chunk_tokens=4096, shard_tokens=65536)
        for i in range(SAMPLES):
            prompt = list(range(TOKENS // 4))
            writer.add(i, prompt, list(range(TOKENS - len(prompt))), truncated=False)
        writer.add_hidden(torch.randn(SAMPLES * TOKENS, TAPS, WIDTH, generator=g).to(torch.bfloat16))
        writer.commit(None, run={})
    assert np.dtype(layout.ARRAY_DTYPES["tokens"]).itemsize == 4


def rss_mb() -> float:
    import psutil

    return psutil.Process().memory_info().rss / 2**20


def measure(path: str, shards: int) -> dict:
    """In this (fresh) process: the index's time and peak memory, then a worker's reads."""
    import numpy as np

    from stages.train.data import StoreBatches, index_samples
    from store.hidden_store import HiddenStore

    store = HiddenStore(path)
    base = rss_mb()
    t = time.perf_counter()
    refs = index_samples(store, list(range(shards)), 4096)
    index_s = time.perf_counter() - t
    index_mb = rss_mb() - base
    rng = np.random.default_rng(0)
    batches = [[(refs[k],) for k in rng.integers(0, len(refs), 8)] for _ in range(300)]
    data = StoreBatches(path, batches)
    base, peak = rss_mb(), 0.0
    t = time.perf_counter()
    for i in range(len(batches)):
        data[i]
        peak = max(peak, rss_mb() - base)
    return {"shards": shards, "samples": len(refs), "index_s": round(index_s, 3), "index_rss_growth_mb": round(index_mb, 1),
            "worker_rss_growth_mb": round(peak, 1), "batches_per_s": round(len(batches) / (time.perf_counter() - t), 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shards", default="8,64")
    p.add_argument("--json", default=None)
    p.add_argument("--measure", nargs=2, help=argparse.SUPPRESS)  # internal: PATH SHARDS, in a fresh process
    args = p.parse_args()
    if args.measure:
        print(json.dumps(measure(args.measure[0], int(args.measure[1]))))
        return
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in map(int, args.shards.split(",")):
            path = Path(tmp) / f"s{n}.zarr"
            build(path, n)
            out = subprocess.run([sys.executable, __file__, "--measure", str(path), str(n)], capture_output=True,
                                 text=True, check=True)
            results.append(json.loads(out.stdout.splitlines()[-1]))
            print(results[-1], file=sys.stderr)
    emit({"samples_per_shard": SAMPLES, "tokens_per_sample": TOKENS, "results": results}, args.json)


if __name__ == "__main__":
    main()

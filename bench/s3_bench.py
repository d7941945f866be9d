"""Reading a store through a real S3 API against the local disk: samples/s a loader worker reads,
and training's start-up at thousands of shards, with the requests each takes.

    python bench/s3_bench.py --local /work/bench/hs.zarr --shards 0-7 --samples 300 \\
        [--startup /tmp/s2442.zarr] [--json bench/results/s3.json]

Starts moto's S3 server on 127.0.0.1 (tests/s3.py; its venv is built once), copies the root and
--shards of --local into s3://bench/hs.zarr, then reads the same --samples random samples (fixed
seed, one ShardReader per shard as a loader worker keeps them) from each, one thread, and reports
samples/s, MB/s of states and the server's request count. With --startup (a store made by
bench/startup_bench.py build) it copies that store too and times train.py's setup on it through
S3 (bench/startup_bench.py's child, one rank), with the requests it made. moto serves from memory
on the same 2 cores as the client: the figures say what the client code costs per request and how
many requests it makes, not what a real object store's latency gives.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from store import index_file  # noqa: E402
from tests.s3 import serving  # noqa: E402


def upload(local: str, url: str, shards: list[int] | None) -> float:
    """Copy the store's root files and the given shards (None: all) -> seconds."""
    import fsspec

    from store import layout

    fs = fsspec.filesystem("s3")
    t = time.perf_counter()
    base = Path(local)
    keep = None if shards is None else {layout.shard_group(s) for s in shards} | {layout.commit_key(s) for s in shards}
    files = []
    for p in base.rglob("*"):
        if not p.is_file():
            continue
        key = p.relative_to(base).as_posix()
        if keep is not None and key.startswith(("shards/", "_commits/")) and not any(
                key == k or key.startswith(k + "/") for k in keep) and key != layout.commit_key("root"):
            continue
        if key.startswith(("_locks/", "_index/")):  # no lock, and no index file: the first launch builds it
            continue
        files.append((str(p), f"{url}/{key}"))
    fs.put([a for a, _ in files], [b for _, b in files])
    return time.perf_counter() - t


def read_samples(location: str, shards: list[int], n: int) -> dict:
    import numpy as np

    from stages.train.data import index_samples
    from store.hidden_store import HiddenStore
    from store.shard_reader import ShardReader

    store = HiddenStore(location)
    refs = index_samples(store, shards, 1 << 30)
    picks = np.random.default_rng(0).choice(len(refs), min(n, len(refs)), replace=False)
    readers, nbytes = {}, 0
    t = time.perf_counter()
    for k in picks:
        r = refs[k]
        reader = readers.get(r.shard) or readers.setdefault(r.shard, ShardReader(store, r.shard))
        nbytes += reader[r.index].hidden.numel() * 2
    s = time.perf_counter() - t
    return {"samples": len(picks), "s": round(s, 2), "samples_per_s": round(len(picks) / s, 1),
            "mb_per_s": round(nbytes / s / 1e6, 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--local", required=True)
    p.add_argument("--shards", default="0-7")
    p.add_argument("--samples", type=int, default=300)
    p.add_argument("--startup", help="a many-shard store (bench/startup_bench.py build) to time start-up on")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    from store.ranges import parse_ranges

    shards = parse_ranges(args.shards, 1 << 20)
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        with serving(Path(tmp) / "moto.log", "bench") as server:
            url = "s3://bench/hs.zarr"
            out["upload_s"] = round(upload(args.local, url, shards), 1)
            out["local"] = read_samples(args.local, shards, args.samples)
            before = server.requests()
            out["s3"] = {**read_samples(url, shards, args.samples), "requests": server.requests() - before}
            if args.startup:
                from bench.startup_bench import time_ranks

                many = "s3://bench/many.zarr"
                out["startup_upload_s"] = round(upload(args.startup, many, None), 1)
                for launch in ("first", "next"):  # the first launch builds the index file, the next reads it
                    before = server.requests()
                    out[f"startup_s3_{launch}"] = {**time_ranks(many, 1, "2400-2441")[0],
                                                   "requests": server.requests() - before}
                shutil.rmtree(Path(args.startup) / index_file.FOLDER, ignore_errors=True)
                for launch in ("first", "next"):
                    out[f"startup_local_{launch}"] = time_ranks(args.startup, 1, "2400-2441")[0]
    print(json.dumps(out, indent=1))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()

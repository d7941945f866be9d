"""Two epochs of sample reads from an object store with and without the node-local cache
(store/node_cache.py, train.py --cache-dir): requests and bytes fetched from the store, and samples/s
of one loader worker in each epoch, through moto's S3 server behind the latency proxy
(tools/s3/latency_proxy.py) at 27B width (synthetic shards, as bench/s3_reads.py builds them).

    python bench/node_cache_bench.py --tiny tiny.zarr --wide /tmp/wide16.zarr \\
        --json bench/results/node_cache.json

--tiny: a store whose root (attributes, embedding) the synthetic shards are written under (the
shipped tiny target's, `pipeline extract --shards 0-7`); --wide: the synthetic store, built when
absent (--shards shards of 4 samples of ~1,950 tokens, hidden 5120, 2 taps, random bf16). For each
mode a child process (one worker) reads every sample in batches of BATCH, its readers kept, epoch 2
in another order; with the cache, a second child (another process of the node: another rank or
worker) then reads epoch 3 through the same cache directory with readers of its own. The proxy counts
each epoch's requests and response bytes. moto serves from memory on the same 2 cores as the
client: seconds here are CPU-bound, not a real store's; requests and bytes are exact.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DELAY_MS = 50
BATCH = 4


def child(location: str, cache_dir: str | None, epochs: int, counts_url: str) -> None:
    """Read every sample of the store `epochs` times (orders fixed by seed), readers kept; per epoch
    its requests, bytes and seconds, as one JSON line."""
    import urllib.request

    import numpy as np

    from store.hidden_store import HiddenStore
    from store.node_cache import NodeCache
    from store.shard_reader import ShardReader, read_samples

    counts = lambda: json.loads(urllib.request.urlopen(counts_url).read())  # noqa: E731
    store = HiddenStore(location, node_cache=None if cache_dir is None else NodeCache(cache_dir, 1 << 40))
    readers = {shard: ShardReader(store, shard) for shard in sorted(store.committed())}
    refs = [(s, i) for s, r in readers.items() for i in range(len(r))]
    rng = np.random.default_rng(len(os.path.basename(cache_dir or "")) + epochs)
    out = []
    for _ in range(epochs):
        order = [refs[k] for k in rng.permutation(len(refs))]
        before, t = counts(), time.perf_counter()
        for lo in range(0, len(order), BATCH):
            got = read_samples([(readers[s], i, None, None) for s, i in order[lo:lo + BATCH]])
            assert all(not isinstance(x, Exception) for x in got), got
        s, after = time.perf_counter() - t, counts()
        out.append({"samples": len(order), "s": round(s, 3), "requests": after["requests"] - before["requests"],
                    "bytes": after["bytes"] - before["bytes"]})
    print(json.dumps(out))


def run_child(server, url: str, cache_dir: str | None, epochs: int) -> list[dict]:
    from tools.s3.latency_proxy import LatencyProxy

    proxy = LatencyProxy(server.url, DELAY_MS / 1000).start()
    env = {**os.environ, **server.env, "FSSPEC_S3_ENDPOINT_URL": proxy.url, "PYTHONPATH": str(ROOT),
           "OMP_NUM_THREADS": "1"}
    args = [sys.executable, str(Path(__file__).resolve()), "--child", url, "--epochs", str(epochs), "--counts",
            f"{proxy.url}/__counts__", *(["--cache-dir", cache_dir] if cache_dir else [])]
    p = subprocess.run(args, env=env, capture_output=True, text=True, cwd=ROOT)
    proxy.stop()
    if p.returncode:
        raise RuntimeError(p.stderr[-3000:])
    return json.loads(p.stdout.strip().splitlines()[-1])


def figures(epoch: dict, used: int) -> dict:
    return {**epoch, "requests_per_sample": round(epoch["requests"] / epoch["samples"], 2),
            "fetched_per_used": round(epoch["bytes"] / used, 3),
            "samples_per_s": round(epoch["samples"] / epoch["s"], 2)}


def used_bytes(local: Path) -> int:
    """Bytes on disk of every sample's states, tokens and loss mask (what reading all samples uses)."""
    from store.hidden_store import HiddenStore

    store = HiddenStore(str(local))
    return sum(n for shard in store.committed() for f, n in store._file_sizes(f"shards/{shard:05d}").items()
               if f.split("/")[0] in ("hidden", "tokens", "loss_mask") and not f.endswith("zarr.json"))


def measure(wide: Path, used: int) -> dict:
    """One round: moto started, the store uploaded, each mode's children run."""
    from bench.s3_bench import upload
    from tests.s3 import serving

    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        with serving(Path(tmp) / "moto.log", "bench") as server:
            url = "s3://bench/wide.zarr"
            upload(str(wide), url, None)
            for k, e in enumerate(run_child(server, url, None, 2)):
                out[f"no_cache_epoch{k + 1}"] = figures(e, used)
            cache = str(Path(tmp) / "cache")
            for k, e in enumerate(run_child(server, url, cache, 2)):
                out[f"cache_epoch{k + 1}"] = figures(e, used)
            out["cache_epoch3_other_process"] = figures(run_child(server, url, cache, 1)[0], used)
            out["cache_bytes_on_disk"] = sum(f.stat().st_size for f in Path(cache).rglob("*") if f.is_file()
                                             and not f.name.startswith("index.sqlite"))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", type=Path)
    p.add_argument("--wide", type=Path)
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--json", type=Path)
    p.add_argument("--repeat", type=int, default=3, help="rounds; seconds are their median")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--epochs", type=int, help=argparse.SUPPRESS)
    p.add_argument("--counts", help=argparse.SUPPRESS)
    p.add_argument("--cache-dir", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child, args.cache_dir, args.epochs, args.counts)
        return
    if args.wide is None:
        p.error("--wide is required")
    from bench import s3_reads

    if not args.wide.exists():
        s3_reads.WIDE_SHARDS = args.shards
        s3_reads.build_wide(args.wide, args.tiny)
    used = used_bytes(args.wide)
    runs = [measure(args.wide, used) for _ in range(args.repeat)]
    out = {"delay_ms": DELAY_MS, "batch": BATCH, "used_bytes": used, "repeats": args.repeat, **runs[0]}
    for key, first in runs[0].items():  # requests and bytes are the same every time; seconds: the median
        if isinstance(first, dict):
            out[key] = figures({**first, "s": statistics.median(r[key]["s"] for r in runs)}, used)
    print(json.dumps(out, indent=1))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()

"""Sample reads from an object store, before and after issue 38's batched ranged reads: requests per
sample, bytes fetched per byte used and samples/s of one loader worker, through moto's S3 server
behind a proxy that adds a fixed latency to every request (tools/s3/latency_proxy.py).

    git archive 1c3001b | tar -x -C /tmp/before          # the code before, to read with
    python bench/s3_reads.py --tiny /tmp/tiny.zarr --before /tmp/before [--wide /tmp/wide.zarr] \\
        --json bench/results/s3_reads.json
    python bench/s3_reads.py --like /tmp/tiny.zarr --wide /tmp/wide16k.zarr --wide-shard-tokens 16384  # the 27B rows of
        bench/results/inodes.json: the states in 16,384-token files instead of 4,096

--tiny: the shipped tiny target's store (`pipeline extract --shards 0-7`); --wide: synthetic shards at
27B width (hidden 5120, built here with the store's own writer when absent: WIDE_SHARDS shards of
WIDE_SAMPLES samples of ~1,950 tokens, WIDE_TAPS taps, the tiny store's root). Each store is copied
into moto; then, for each code (before, after) and latency (0, and DELAY_MS of the width), a child
process running that code reads the same samples in batches of BATCH (the after code: one
read_samples call a batch; the before code: one read a sample, as its loader did), twice with its
readers kept (pass 1 opens them, pass 2 reads in another order, as a kept worker's next epoch), and
the proxy counts its requests and response bytes per pass. "Used" bytes are the samples' share of
their shards' states, tokens and loss mask on disk (tokens x bytes per token). moto serves from
memory on the same 2 cores as the client: seconds here are CPU-bound, not a real store's.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if "--child" not in sys.argv:  # a child reads with the code its PYTHONPATH names
    sys.path.insert(0, str(ROOT))

DELAY_MS = {"tiny": 300, "wide": 50}
SAMPLES = {"tiny": 80, "wide": 8}
BATCH = 4
WIDE_SHARDS, WIDE_SAMPLES, WIDE_TAPS, WIDE_H, WIDE_TOKENS = 2, 4, 2, 5120, 1950


def build_wide(path: Path, like: Path, shard_tokens: int = 4096) -> None:
    """Synthetic 27B-width shards (random bf16 states) on the tiny store's root."""
    import shutil

    import torch

    from store import layout
    from store.shard_writer import ShardWriter
    from store.store_writer import StoreWriter

    path.mkdir(parents=True)
    for name in ("zarr.json", "target"):
        (shutil.copytree if (like / name).is_dir() else shutil.copy)(like / name, path / name)
    (path / "_commits").mkdir()
    shutil.copy(like / layout.commit_key("root"), path / layout.commit_key("root"))
    store = StoreWriter(str(path))
    g = torch.Generator().manual_seed(0)
    for shard in range(WIDE_SHARDS):
        w = ShardWriter(store, shard, WIDE_TAPS, WIDE_H, chunk_tokens=256, shard_tokens=shard_tokens)
        for i in range(WIDE_SAMPLES):
            n = WIDE_TOKENS + int(torch.randint(-200, 200, (1,), generator=g))
            w.add(i, [1] * 50, [2] * (n - 50), truncated=False)
            w.add_hidden(torch.randn(n, WIDE_TAPS, WIDE_H, generator=g).to(torch.bfloat16))
        w.commit(None, run={})


def child(location: str, n: int, counts_url: str) -> None:
    """Run in the code under test: read n random samples (fixed seed) in batches, two passes."""
    import urllib.request

    import numpy as np

    from store.hidden_store import HiddenStore
    from store.shard_reader import ShardReader

    try:
        from store.shard_reader import read_samples
    except ImportError:  # the code before: one sample at a time
        read_samples = None
    counts = lambda: json.loads(urllib.request.urlopen(counts_url).read())  # noqa: E731
    store = HiddenStore(location)
    refs = []
    for shard in sorted(store.committed()):
        offsets = ShardReader(store, shard).offsets
        refs += [(shard, i, int(offsets[i + 1] - offsets[i])) for i in range(len(offsets) - 1)]
    rng = np.random.default_rng(0)
    picks = [refs[k] for k in rng.choice(len(refs), min(n, len(refs)), replace=False)]
    readers, out = {}, []
    for order in (picks, [picks[k] for k in rng.permutation(len(picks))]):
        before, t = counts(), time.perf_counter()
        for lo in range(0, len(order), BATCH):
            batch = order[lo:lo + BATCH]
            for s, _, _ in batch:
                if s not in readers:
                    readers[s] = ShardReader(store, s)
            if read_samples is None:
                got = [readers[s].read(i) for s, i, _ in batch]
            else:
                got = read_samples([(readers[s], i, None, None) for s, i, _ in batch])
            assert all(not isinstance(x, Exception) for x in got), got
        s, after = time.perf_counter() - t, counts()
        out.append({"samples": len(order), "s": round(s, 3), "requests": after["requests"] - before["requests"],
                    "bytes": after["bytes"] - before["bytes"], "picks": [[a, k] for a, _, k in order]})
    print(json.dumps(out))


def bytes_per_token(local: Path) -> dict[int, float]:
    """Shard -> bytes on disk of its states, tokens and loss mask per token."""
    from store.hidden_store import HiddenStore

    store = HiddenStore(str(local))
    out = {}
    for shard, rec in store.committed().items():
        files = store._file_sizes(f"shards/{shard:05d}")
        n = sum(v for f, v in files.items() if f.split("/")[0] in ("hidden", "tokens", "loss_mask")
                and not f.endswith("zarr.json"))
        out[shard] = n / rec.tokens
    return out


def measure(name: str, local: Path, trees: dict[str, Path], server) -> dict:
    """The figures of one store: per code and latency, each pass's requests, bytes and seconds."""
    from bench.s3_bench import upload
    from tools.s3.latency_proxy import LatencyProxy

    url = f"s3://bench/{name}.zarr"
    upload(str(local), url, None)
    per_token = bytes_per_token(local)
    result = {"delay_ms": DELAY_MS[name], "batch": BATCH}
    for code, tree in trees.items():
        for delay in (0, DELAY_MS[name]):
            proxy = LatencyProxy(server.url, delay / 1000).start()
            env = {**os.environ, **server.env, "FSSPEC_S3_ENDPOINT_URL": proxy.url, "PYTHONPATH": str(tree),
                   "OMP_NUM_THREADS": "1"}
            p = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", url, "--n",
                                str(SAMPLES[name]), "--counts", f"{proxy.url}/__counts__"], env=env,
                               capture_output=True, text=True, cwd=tree)
            proxy.stop()
            if p.returncode:
                raise RuntimeError(p.stderr[-3000:])
            for k, ps in enumerate(json.loads(p.stdout.strip().splitlines()[-1])):
                used = sum(per_token[shard] * n for shard, n in ps.pop("picks"))
                result[f"{code}_{delay}ms_pass{k + 1}"] = {
                    **ps, "requests_per_sample": round(ps["requests"] / ps["samples"], 2),
                    "fetched_per_used": round(ps["bytes"] / used, 3),
                    "samples_per_s": round(ps["samples"] / ps["s"], 2)}
        print(json.dumps({k: v for k, v in result.items() if code in k}), flush=True)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", type=Path)
    p.add_argument("--wide", type=Path)
    p.add_argument("--before", type=Path, help="a copy of the code before (git archive), to read with")
    p.add_argument("--like", type=Path, help="the store whose root --wide is built on (default: --tiny)")
    p.add_argument("--wide-shard-tokens", type=int, default=4096, help="tokens per state file of the --wide store built")
    p.add_argument("--json", type=Path)
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--n", type=int, help=argparse.SUPPRESS)
    p.add_argument("--counts", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child, args.n, args.counts)
        return
    from tests.s3 import serving

    if args.wide and not args.wide.exists():
        build_wide(args.wide, args.like or args.tiny, args.wide_shard_tokens)
    trees = {"after": ROOT, **({"before": args.before} if args.before else {})}
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        with serving(Path(tmp) / "moto.log", "bench") as server:
            for name, local in (("tiny", args.tiny), ("wide", args.wide)):
                if local:
                    out[name] = measure(name, local, trees, server)
    print(json.dumps(out, indent=1))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()

"""bf16 state layouts side by side: size, write and read speed, random sample reads.

    python bench/store_bench.py --store hs.zarr [--threads 1,2] [--json bench/results/store_cpu.json]

Reads every committed shard's states from a store (the shipped target's full store, say) and
writes them again through zarr in each candidate layout, with the store's chunking (256-token
chunks in 4,096-token shard files): today's (blosc zstd-3, byte shuffle), blosc zstd-1 with bit
shuffle (built-in codecs only), and this package's byte-plane codec (store/codec.py: high plane
zstd-1, low plane raw or LZ4), the last three with a crc32c checksum per chunk. Two kinds of data:
the store as it is, and the same states with every repeated token row dropped (prompts that share
a template prefix give identical rows, which some layouts find and others cannot). Reported per
layout and data: size against raw bf16, write MB/s (raw) with 1..N zarr threads, sequential read
MB/s, and the median time to read one random sample. blosc runs one thread inside each call, so
thread counts compare like with like. Best of 3 per figure.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numcodecs.blosc  # noqa: E402
import numpy as np  # noqa: E402
import zarr  # noqa: E402
from zarr.codecs import BloscCodec, BloscShuffle, Crc32cCodec  # noqa: E402

from store.codec import Bf16Planes  # noqa: E402
from store.hidden_store import HiddenStore  # noqa: E402

LAYOUTS = {
    "blosc zstd-3 byte shuffle (today)": lambda: [BloscCodec(cname="zstd", clevel=3, shuffle=BloscShuffle.shuffle,
                                                             typesize=2)],
    "blosc zstd-1 bit shuffle + crc32c": lambda: [BloscCodec(cname="zstd", clevel=1, shuffle=BloscShuffle.bitshuffle,
                                                             typesize=2), Crc32cCodec()],
    "planes zstd-1 / raw + crc32c": lambda: [Bf16Planes(level=1, low="raw"), Crc32cCodec()],
    "planes zstd-1 / lz4 + crc32c": lambda: [Bf16Planes(level=1, low="lz4"), Crc32cCodec()],
}


def load(path: str) -> tuple[np.ndarray, np.ndarray]:
    """Every committed shard's states, [T, n_taps, H] uint16, and the sample offsets."""
    store = HiddenStore(path)
    parts, offsets = [], [0]
    for shard in store.committed():
        g = store.shard_arrays(shard)
        parts.append(g["hidden"][:])
        offsets += [offsets[-1] + int(n) for n in np.diff(g["offsets"][:])]
    return np.concatenate(parts), np.asarray(offsets)


def without_repeats(x: np.ndarray) -> np.ndarray:
    _, first = np.unique(x.reshape(len(x), -1), axis=0, return_index=True)
    return x[np.sort(first)]


def best(f, n: int = 3) -> float:
    times = []
    for _ in range(n):
        t = time.perf_counter()
        f()
        times.append(time.perf_counter() - t)
    return min(times)


def measure(x: np.ndarray, offsets: np.ndarray, codecs, threads: list[int], tmp: Path) -> dict:
    shape, raw = x.shape, x.nbytes
    chunk, shard = (256, *shape[1:]), (4096, *shape[1:])

    def write(k: int):
        a = zarr.create_array(str(tmp / f"w{k}.zarr"), shape=shape, dtype=np.uint16, chunks=chunk, shards=shard,
                              compressors=codecs(), fill_value=0, overwrite=True)
        for s in range(0, len(x), shard[0]):
            a[s:s + shard[0]] = x[s:s + shard[0]]
        return a

    out = {"write_MBps": {}}
    for n in threads:
        with zarr.config.set({"threading.max_workers": n}):
            out["write_MBps"][n] = round(raw / best(lambda: write(n)) / 1e6)
    path = tmp / f"w{threads[-1]}.zarr"
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    a = zarr.open_array(str(path), mode="r")
    assert np.array_equal(a[:], x)
    with zarr.config.set({"threading.max_workers": 1}):
        out["read_MBps"] = round(raw / best(lambda: a[:]) / 1e6)
        rng = np.random.default_rng(0)
        picks = rng.integers(0, len(offsets) - 1, 200)
        sample_s = []
        for i in picks:
            t = time.perf_counter()
            a[offsets[i]:offsets[i + 1]]
            sample_s.append(time.perf_counter() - t)
    out["sample_read_ms"] = round(1e3 * statistics.median(sample_s), 3)
    out["ratio"] = round(size / raw, 4)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store", required=True)
    p.add_argument("--threads", default="1,2")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    numcodecs.blosc.set_nthreads(1)
    threads = [int(t) for t in args.threads.split(",")]
    x, offsets = load(args.store)
    data = {"store as it is": (x, offsets)}
    y = without_repeats(x)
    data["repeated rows dropped"] = (y, np.linspace(0, len(y), len(offsets)).astype(np.int64))
    result = {"store": args.store, "threads": threads, "results": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for label, (d, off) in data.items():
            print(f"== {label}: {d.shape}, {d.nbytes / 1e6:.1f} MB raw", file=sys.stderr)
            for name, codecs in LAYOUTS.items():
                r = measure(d, off, codecs, threads, Path(tmp))
                print(f"{name:38s} {json.dumps(r)}", file=sys.stderr)
                result["results"].setdefault(label, {})[name] = r
    text = json.dumps(result, indent=1)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")


if __name__ == "__main__":
    main()

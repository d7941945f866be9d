"""bf16 state layouts side by side: size, write and read speed, random sample reads.

    python bench/store_bench.py --store hs.zarr [--threads 1] [--wide-tokens 2048] [--json bench/results/store_cpu_1thread.json]

Reads every committed shard's states from a store (the shipped target's full store, say) and
writes them again through zarr in each candidate layout, with the store's chunking (256-token
chunks in 4,096-token shard files): today's (blosc zstd-3, byte shuffle), blosc zstd-1 with bit
shuffle (built-in codecs only), and this package's byte-plane codec (store/codec.py: high plane
zstd-1, low plane raw or LZ4), the last three with a crc32c checksum per chunk. Two kinds of data:
the store as it is, the same states with every repeated token row dropped (prompts that share a
template prefix give identical rows, which some layouts find and others cannot), and states of
Qwen3.6-27B's shape ([T, 5, 5120]) from a random-initialised model run on the store's tokens
(27B-sized chunks, 13 MB each, where codec speed rather than zarr's per-chunk overhead counts). Reported per
layout and data: size against raw bf16, write and sequential read MB/s (of raw bf16) with
`--threads` codec threads in zarr's pool, and the median time to read one random sample; for the
layouts store/span_reader.py decodes (the planes ones), the same two reads straight from the chunk
files, one thread (what training's ShardReader does). blosc runs one thread inside each call, so
thread counts compare like with like. Best of 3 per figure.
Then the extractor's own ShardWriter on the 27B-width states (schema 1: blosc through zarr;
schema 2: whole shard files encoded by the writer, store/shard_file.py), with `--threads` threads:
MB/s as fast as it takes batches, and the producer's stall when a GPU-like producer hands it
500 MB/s with room for two shard files. Last, training's reads of those two stores: ShardReader's
random sample (through zarr for schema 1, straight from the chunk files for schema 2,
store/span_reader.py) and a DataLoader's MB/s with 1 and `--threads` workers.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
if "--threads" in sys.argv:  # zarr sizes its codec thread pool once, from the environment, at first use
    os.environ["ZARR_THREADING__MAX_WORKERS"] = sys.argv[sys.argv.index("--threads") + 1]
else:
    os.environ["ZARR_THREADING__MAX_WORKERS"] = "1"

import fsspec  # noqa: E402
import numcodecs.blosc  # noqa: E402
import numpy as np  # noqa: E402
import zarr  # noqa: E402
from zarr.codecs import BloscCodec, BloscShuffle, Crc32cCodec  # noqa: E402

from bench.report import emit  # noqa: E402
from pipeline import fingerprint  # noqa: E402
from store import layout, span_reader  # noqa: E402
from store.codec import Bf16Planes  # noqa: E402
from store.hidden_store import HiddenStore  # noqa: E402
from store.store_writer import StoreWriter  # noqa: E402

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
    parts, lengths = [], []
    for shard in store.committed():
        g = store.shard_arrays(shard)
        parts.append(g["hidden"][:])
        lengths.append(np.diff(g["offsets"][:]))
    return np.concatenate(parts), np.concatenate([[0], np.cumsum(np.concatenate(lengths))])


def wide_states(tokens: np.ndarray) -> np.ndarray:
    """States of Qwen3.6-27B's width (5,120) and tap count (5): a random-initialised 5-layer
    qwen3_5_text (the 27B's layer pattern, narrower heads and MLP) run on real token ids."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

    sys.modules.setdefault("fla", None)
    torch.set_flush_denormal(True)
    config = Qwen3_5TextConfig(
        vocab_size=4096, hidden_size=5120, intermediate_size=1024, num_hidden_layers=5,
        layer_types=["linear_attention"] * 3 + ["full_attention", "linear_attention"], num_attention_heads=8,
        num_key_value_heads=2, head_dim=128, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=128, linear_value_head_dim=128, max_position_embeddings=len(tokens))
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        out = model.model(torch.from_numpy(tokens.astype(np.int64))[None], output_hidden_states=True)
    hidden = torch.stack([out.hidden_states[k + 1][0] for k in range(5)], 1)  # [T, 5, 5120] bf16
    return hidden.contiguous().view(torch.int16).numpy().view(np.uint16)


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


def measure(x: np.ndarray, offsets: np.ndarray, codecs, tmp: Path) -> dict:
    shape, raw = x.shape, x.nbytes
    chunk, shard = (256, *shape[1:]), (4096, *shape[1:])

    path = tmp / "w.zarr"

    def write():
        a = zarr.create_array(str(path), shape=shape, dtype=np.uint16, chunks=chunk, shards=shard,
                              compressors=codecs(), fill_value=0, overwrite=True)
        for s in range(0, len(x), shard[0]):
            a[s:s + shard[0]] = x[s:s + shard[0]]

    out = {"write_MBps": round(raw / best(write) / 1e6)}
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    a = zarr.open_array(str(path), mode="r")
    assert np.array_equal(a[:], x)
    out["read_MBps"] = round(raw / best(lambda: a[:]) / 1e6)
    picks = np.random.default_rng(0).integers(0, len(offsets) - 1, 200)
    sample_s = []
    for i in picks:
        t = time.perf_counter()
        a[offsets[i]:offsets[i + 1]]
        sample_s.append(time.perf_counter() - t)
    out["sample_read_ms"] = round(1e3 * statistics.median(sample_s), 3)
    direct = span_reader.for_array(fsspec.filesystem("file"), str(path), a)
    if direct is not None:  # the same file read straight from its chunks, as ShardReader does
        assert np.array_equal(direct.read(0, len(x)), x)
        out["direct_read_MBps"] = round(raw / best(lambda: direct.read(0, len(x))) / 1e6)
        sample_s = []
        for i in picks:
            t = time.perf_counter()
            direct.read(int(offsets[i]), int(offsets[i + 1]))
            sample_s.append(time.perf_counter() - t)
        out["direct_sample_read_ms"] = round(1e3 * statistics.median(sample_s), 3)
    out["ratio"] = round(size / raw, 4)
    return out


def root_of(store: str, path: Path, x: np.ndarray, hidden_format: str) -> None:
    """A store root at path for states like x ([T, n_taps, H]): `store`'s attributes at x's width
    and in hidden_format, with a zero embedding and lm_head, so the shards a bench writes there read
    back through HiddenStore and training's loader."""
    import dataclasses

    import torch

    from store.schema import to_json

    attrs = HiddenStore(store).attrs
    compat = dataclasses.replace(attrs.compat.as_format(hidden_format), taps=tuple(range(x.shape[1])),
                                 codec=layout.FORMAT_CODECS[hidden_format])
    attrs = dataclasses.replace(attrs, compat=compat, fingerprint=fingerprint.sha256_json(to_json(compat)),
                                hidden_size=x.shape[2], taps=compat.taps)
    zeros = torch.zeros(attrs.vocab_size, x.shape[2], dtype=torch.bfloat16)
    StoreWriter(str(path)).create_or_check(attrs, zeros, zeros)


def writer(x: np.ndarray, hidden_format: str, threads: int, tmp: Path, producer_mb_s: float | None = None,
           root: str | None = None) -> dict:
    """The extractor's ShardWriter on x (16 passes; fp8: x already rounded, as the capture hands it
    over), as fast as it takes batches of 256 tokens or fed at producer_mb_s with room for two shard
    files (the default --writer-memory-gb is 4 GiB, about 20 at 27B width): MB/s (of raw bf16) until
    committed, and the producer's stall. root: a store whose root to copy (for `reader`)."""
    import shutil

    import torch

    from store.shard_writer import ShardWriter

    states = torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
    batch = 256
    batch_bytes = batch * x[0].nbytes
    path = tmp / f"writer-{hidden_format}.zarr"
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir()
    if root:
        root_of(root, path, x, hidden_format)
    store = StoreWriter(str(path))
    w = ShardWriter(store, 0, x.shape[1], x.shape[2], chunk_tokens=256, shard_tokens=4096,
                    threads=threads, hidden_format=hidden_format, max_held_bytes=2 * 4096 * x[0].nbytes if producer_mb_s else 1 << 40)
    t0 = time.perf_counter()
    for k in range(16 * len(x) // batch):
        if producer_mb_s:
            while time.perf_counter() < t0 + k * batch_bytes / (producer_mb_s * 1e6):
                time.sleep(0.0005)
        a = (k * batch) % len(x)
        w.add(k, [1], [2] * (batch - 1), truncated=False)
        w.add_hidden(states[a:a + batch].clone())
    fed = time.perf_counter() - t0
    w.commit(None, run={})
    total = time.perf_counter() - t0
    out = {"MBps": round(16 * x.nbytes / total / 1e6)}
    if producer_mb_s:
        out.update(producer_MBps=producer_mb_s, stall_s=round(w.stall_s, 3), stall_share=round(w.stall_s / fed, 3))
    return out


def reader(path: Path, workers: list[int]) -> dict:
    """The training side of a store the writer made (samples of 256 tokens, 13 MB at 27B width):
    the median time ShardReader takes to read one random sample, and the raw MB/s a DataLoader
    delivers with each worker count (batches of 4 random samples, as training reads them)."""
    import torch

    from stages.train.data import Ref, StoreBatches
    from store.shard_reader import ShardReader

    r = ShardReader(HiddenStore(str(path)), 0)
    rng = np.random.default_rng(0)
    times = []
    for i in rng.integers(0, len(r), 60):
        t = time.perf_counter()
        r.read(int(i))
        times.append(time.perf_counter() - t)
    out = {"sample_read_ms": round(1e3 * statistics.median(times), 2), "loader_MBps": {}}
    lengths = np.diff(r.offsets)
    batches = [[(Ref(0, int(i), int(lengths[i])),) for i in rng.integers(0, len(r), 4)] for _ in range(48)]
    for n in workers:
        loader = torch.utils.data.DataLoader(StoreBatches(str(path), batches), batch_size=None, num_workers=n,
                                             prefetch_factor=2)
        it = iter(loader)
        next(it)  # workers started and warm
        t, raw = time.perf_counter(), 0
        for batch in it:
            raw += batch.hidden.numel() * 2
        out["loader_MBps"][n] = round(raw / (time.perf_counter() - t) / 1e6)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store", required=True)
    p.add_argument("--threads", type=int, default=1, help="zarr's codec threads (each a core's worth of work)")
    p.add_argument("--wide-tokens", type=int, default=2048, help="tokens of 27B-width states (0: none)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    numcodecs.blosc.set_nthreads(1)
    x, offsets = load(args.store)
    data = {"store as it is": (x, offsets)}
    y = without_repeats(x)
    data["repeated rows dropped"] = (y, np.linspace(0, len(y), len(offsets)).astype(np.int64))
    if args.wide_tokens:
        tokens = np.concatenate([HiddenStore(args.store).shard_arrays(s)["tokens"][:]
                                 for s in HiddenStore(args.store).committed()])[:args.wide_tokens]
        w = wide_states(tokens)
        data["27B width (random-init forward)"] = (w, np.arange(0, len(w) + 1, 512))
    result = {"store": args.store, "threads": args.threads, "results": {}}
    with tempfile.TemporaryDirectory() as tmp:
        if args.wide_tokens:
            for codec in ("planes",):  # blosc, retired as a write option, was measured before (bench/results)
                r = {"as fast as it takes": writer(w, "bf16", args.threads, Path(tmp)),
                     "at 500 MB/s": writer(w, "bf16", args.threads, Path(tmp), producer_mb_s=500, root=args.store)}
                print(f"ShardWriter, 27B width, {codec:6s} {json.dumps(r)}", file=sys.stderr)
                result.setdefault("writer", {})[codec] = r
                r = reader(Path(tmp) / "writer-bf16.zarr", sorted({1, args.threads}))
                print(f"ShardReader, 27B width, {codec:6s} {json.dumps(r)}", file=sys.stderr)
                result.setdefault("reader", {})[codec] = r
        for label, (d, off) in data.items():
            print(f"== {label}: {d.shape}, {d.nbytes / 1e6:.1f} MB raw", file=sys.stderr)
            for name, codecs in LAYOUTS.items():
                r = measure(d, off, codecs, Path(tmp))
                print(f"{name:38s} {json.dumps(r)}", file=sys.stderr)
                result["results"].setdefault(label, {})[name] = r
    emit(result, args.json)


if __name__ == "__main__":
    main()

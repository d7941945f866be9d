"""How states are stored: bf16 layouts side by side (`layouts`), and the fp8 format against bf16 (`fp8`).

    python -m bench.store_bench layouts --store hs.zarr [--threads 1] [--wide-tokens 2048] \\
        [--json bench/results/store_cpu_1thread.json]
    pipeline extract --store bf16.zarr --shards 0-63
    pipeline extract --store fp8.zarr --shards 0-63 --hidden-format fp8
    python -m bench.store_bench fp8 --bf16 bf16.zarr --fp8 fp8.zarr [--wide-tokens 2048] \\
        [--json bench/results/fp8_cpu.json]

`layouts` reads every committed shard's states from a store (the shipped target's full store, say)
and writes them again through zarr in each candidate layout, with the store's chunking (256-token
chunks in 4,096-token shard files): blosc zstd-3 with byte shuffle, blosc zstd-1 with bit shuffle
(built-in codecs only), and this package's byte-plane codec (store/format/bf16_codec.py: high plane zstd-1, low
plane raw or LZ4), the last three with a crc32c checksum per chunk. Three kinds of data: the store
as it is, the same states with every repeated token row dropped (prompts that share a template
prefix give identical rows, which some layouts find and others cannot), and states of
Qwen3.6-27B's shape ([T, 5, 5120]) from a random-initialised model run on the store's tokens
(27B-sized chunks, 13 MB each, where codec speed rather than zarr's per-chunk overhead counts).
Reported per layout and data: size against raw bf16, write and sequential read MB/s (of raw bf16)
with `--threads` codec threads in zarr's pool, and the median time to read one random sample; for
the layouts store/span_reader.py decodes (the planes ones), the same two reads straight from the
chunk files, one thread (what training's ShardReader does). blosc runs one thread inside each call,
so thread counts compare like with like. Then the extractor's own ShardWriter on the 27B-width
states, with `--threads` threads: MB/s as fast as it takes batches, and the producer's stall when a
GPU-like producer hands it 500 MB/s with room for two shard files; and training's reads of that
store: ShardReader's random sample and a DataLoader's MB/s with 1 and `--threads` workers.

`fp8` takes the shipped target's stores of the same prompts in both formats: the states' bytes on
disk (commit records) against raw bf16, and the round trip's error per tap (max and mean absolute,
relative RMS, and the worst token) between the two stores' states. Then the 27B-width states above
(their first layers barely mix context, so rows repeat where the prompts' template does, which zstd
finds: `unique_rows_per_tap` says how many): the same error figures, the size of each layout
written through zarr, the information in the e4m3 bytes (order-0 entropy of sign, exponent and
mantissa fields: what a coder without context can reach), one core's speed of the rounding (as the
capture runs it on CPU), of zarr's write and of the direct reader, and the ShardWriter with one and
two threads, as fast as it takes and fed at 500 MB/s (an H200 capturing at 27B width).

Speeds are medians of 3 (--toy: 1), MB/s of raw bf16 states. --toy: 256 tokens of 512-wide states.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

if "--threads" in sys.argv:  # zarr sizes its codec thread pool once, from the environment, at first use
    os.environ["ZARR_THREADING__MAX_WORKERS"] = sys.argv[sys.argv.index("--threads") + 1]
else:
    os.environ["ZARR_THREADING__MAX_WORKERS"] = "1"

import numpy as np  # noqa: E402

from bench import harness  # noqa: E402

TOY = [["layouts", "--store", "{store}"], ["fp8", "--bf16", "{store}", "--fp8", "{fp8_store}"]]
WIDE_H, TOY_H = 5120, 512  # the 27B's width; the toy run's


def layouts():
    from zarr.codecs import BloscCodec, BloscShuffle, Crc32cCodec

    from store.format.bf16_codec import Bf16Planes

    return {
        "blosc zstd-3 byte shuffle": lambda: [
            BloscCodec(cname="zstd", clevel=3, shuffle=BloscShuffle.shuffle, typesize=2)
        ],
        "blosc zstd-1 bit shuffle + crc32c": lambda: [
            BloscCodec(cname="zstd", clevel=1, shuffle=BloscShuffle.bitshuffle, typesize=2),
            Crc32cCodec(),
        ],
        "planes zstd-1 / raw + crc32c": lambda: [Bf16Planes(level=1, low="raw"), Crc32cCodec()],
        "planes zstd-1 / lz4 + crc32c": lambda: [Bf16Planes(level=1, low="lz4"), Crc32cCodec()],
    }


def timed(f, repeat: int) -> float:
    """Median seconds of f() over repeat calls."""
    return harness.medians(f, repeat)["median_s"]


def sample_ms(read, calls) -> float:
    """Median milliseconds of read(*args) over the argument tuples in calls (one sample each)."""
    t = []
    for args in calls:
        t0 = time.perf_counter()
        read(*args)
        t.append(time.perf_counter() - t0)
    return round(1e3 * harness.median_of(t), 3)


def load(path: str) -> tuple[np.ndarray, np.ndarray]:
    """Every committed shard's states, [T, n_taps, H] uint16, and the sample offsets."""
    from store.hidden_store import HiddenStore

    store = HiddenStore(path)
    parts, lengths = [], []
    for shard in store.committed():
        g = store.shard_arrays(shard)
        parts.append(g["hidden"][:])
        lengths.append(np.diff(g["offsets"][:]))
    return np.concatenate(parts), np.concatenate([[0], np.cumsum(np.concatenate(lengths))])


def store_tokens(path: str, n: int) -> np.ndarray:
    from store.hidden_store import HiddenStore

    store = HiddenStore(path)
    return np.concatenate([store.shard_arrays(s)["tokens"][:] for s in store.committed()])[:n]


def wide_states(tokens: np.ndarray, width: int = WIDE_H) -> np.ndarray:
    """States of Qwen3.6-27B's width (5,120) and tap count (5): a random-initialised 5-layer
    qwen3_5_text (the 27B's layer pattern, narrower heads and MLP) run on real token ids."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3_5TextConfig

    sys.modules.setdefault("fla", None)
    config = Qwen3_5TextConfig(
        vocab_size=4096,
        hidden_size=width,
        intermediate_size=1024,
        num_hidden_layers=5,
        layer_types=["linear_attention"] * 3 + ["full_attention", "linear_attention"],
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=128,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=128,
        linear_value_head_dim=128,
        max_position_embeddings=len(tokens),
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    with torch.no_grad():
        out = model.model(torch.from_numpy(tokens.astype(np.int64) % 4096)[None], output_hidden_states=True)
    hidden = torch.stack([out.hidden_states[k + 1][0] for k in range(5)], 1)  # [T, 5, width] bf16
    return hidden.contiguous().view(torch.int16).numpy().view(np.uint16)


def without_repeats(x: np.ndarray) -> np.ndarray:
    _, first = np.unique(x.reshape(len(x), -1), axis=0, return_index=True)
    return x[np.sort(first)]


def measure(x: np.ndarray, offsets: np.ndarray, codecs, tmp: Path, repeat: int) -> dict:
    """x [T, n_taps, H] uint16 written through zarr with codecs(): size, write/read MB/s, sample reads."""
    import fsspec
    import zarr

    from store import span_reader

    shape, raw = x.shape, x.nbytes
    chunk, shard = (256, *shape[1:]), (4096, *shape[1:])
    path = tmp / "w.zarr"

    def write():
        a = zarr.create_array(
            str(path),
            shape=shape,
            dtype=np.uint16,
            chunks=chunk,
            shards=shard,
            compressors=codecs(),
            fill_value=0,
            overwrite=True,
        )
        for s in range(0, len(x), shard[0]):
            a[s : s + shard[0]] = x[s : s + shard[0]]

    out = {"write_MBps": round(raw / timed(write, repeat) / 1e6)}
    size = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    a = zarr.open_array(str(path), mode="r")
    assert np.array_equal(a[:], x)
    out["read_MBps"] = round(raw / timed(lambda: a[:], repeat) / 1e6)
    picks = [
        (int(offsets[i]), int(offsets[i + 1])) for i in np.random.default_rng(0).integers(0, len(offsets) - 1, 200)
    ]
    out["sample_read_ms"] = sample_ms(lambda s, e: a[s:e], picks)
    direct = span_reader.for_array(fsspec.filesystem("file"), str(path), a)
    if direct is not None:  # the same file read straight from its chunks, as ShardReader does
        assert np.array_equal(direct.read(0, len(x)), x)
        out["direct_read_MBps"] = round(raw / timed(lambda: direct.read(0, len(x)), repeat) / 1e6)
        out["direct_sample_read_ms"] = sample_ms(direct.read, picks)
    out["ratio"] = round(size / raw, 4)
    return out


def root_of(store: str, path: Path, x: np.ndarray, hidden_format: str) -> None:
    """A store root at path for states like x ([T, n_taps, H]): `store`'s attributes at x's width
    and in hidden_format, with a zero embedding and lm_head, so the shards a bench writes there read
    back through HiddenStore and training's loader."""
    import dataclasses

    import torch

    from pipeline import fingerprint
    from store.format import hidden_formats
    from store.format.schema import to_json
    from store.hidden_store import HiddenStore
    from store.store_writer import StoreWriter

    attrs = HiddenStore(store).attrs
    compat = dataclasses.replace(
        attrs.compat.as_format(hidden_format),
        taps=tuple(range(x.shape[1])),
        codec=hidden_formats.of(hidden_format).codec,
    )
    attrs = dataclasses.replace(
        attrs,
        compat=compat,
        fingerprint=fingerprint.sha256_json(to_json(compat)),
        hidden_size=x.shape[2],
        taps=compat.taps,
    )
    zeros = torch.zeros(attrs.vocab_size, x.shape[2], dtype=torch.bfloat16)
    StoreWriter(str(path)).create_or_check(attrs, zeros, zeros)


def writer(
    x: np.ndarray, hidden_format: str, threads: int, tmp: Path, root: str, producer_mb_s: float | None = None
) -> dict:
    """The extractor's ShardWriter on x (16 passes; fp8: x already rounded, as the capture hands it
    over), as fast as it takes batches of 256 tokens or fed at producer_mb_s with room for two shard
    files (the default --writer-memory-gb is 4 GiB, about 20 at 27B width): MB/s (of raw bf16) until
    committed, and the producer's stall. root: a store whose root to copy (the writer codes the states in
    the format of the store it writes, and `reader` reads them back)."""
    import shutil

    import torch

    from store.shard_writer import ShardWriter
    from store.store_writer import StoreWriter

    states = torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
    batch = 256
    batch_bytes = batch * x[0].nbytes
    path = tmp / f"writer-{hidden_format}.zarr"
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir()
    root_of(root, path, x, hidden_format)
    held = 2 * 4096 * x[0].nbytes if producer_mb_s else 1 << 40
    w = ShardWriter(
        StoreWriter(str(path)),
        0,
        x.shape[1],
        x.shape[2],
        chunk_tokens=256,
        shard_tokens=4096,
        threads=threads,
        max_held_bytes=held,
    )
    t0 = time.perf_counter()
    for k in range(16 * len(x) // batch):
        if producer_mb_s:
            while time.perf_counter() < t0 + k * batch_bytes / (producer_mb_s * 1e6):
                time.sleep(0.0005)
        a = (k * batch) % len(x)
        w.add(k, [1], [2] * (batch - 1), truncated=False)
        w.add_hidden(states[a : a + batch].clone())
    fed = time.perf_counter() - t0
    w.commit(None, run={})
    total = time.perf_counter() - t0
    out = {"MBps": round(16 * x.nbytes / total / 1e6)}
    if producer_mb_s:
        out.update(producer_MBps=producer_mb_s, stall_s=round(w.stall_s, 3), stall_share=round(w.stall_s / fed, 3))
    return out


def writer_runs(x: np.ndarray, fmt: str, threads: int, tmp: Path, root: str) -> dict:
    return {
        "as fast as it takes": writer(x, fmt, threads, tmp, root),
        "at 500 MB/s": writer(x, fmt, threads, tmp, root, producer_mb_s=500),
    }


def reader(path: Path, workers: list[int]) -> dict:
    """The training side of a store the writer made (samples of 256 tokens, 13 MB at 27B width):
    the median time ShardReader takes to read one random sample, and the raw MB/s a DataLoader
    delivers with each worker count (batches of 4 random samples, as training reads them)."""
    import torch

    from stages.train.dataset import StoreBatches
    from stages.train.samples import Ref
    from store.hidden_store import HiddenStore
    from store.shard_reader import ShardReader

    r = ShardReader(HiddenStore(str(path)), 0)
    rng = np.random.default_rng(0)
    out = {"sample_read_ms": sample_ms(r.read, [(int(i),) for i in rng.integers(0, len(r), 60)]), "loader_MBps": {}}
    lengths = np.diff(r.offsets)
    batches = [[(Ref(0, int(i), int(lengths[i])),) for i in rng.integers(0, len(r), 4)] for _ in range(48)]
    for n in workers:
        loader = torch.utils.data.DataLoader(
            StoreBatches(str(path), batches), batch_size=None, num_workers=n, prefetch_factor=2
        )
        it = iter(loader)
        next(it)  # workers started and warm
        t, raw = time.perf_counter(), 0
        for batch in it:
            raw += batch.hidden.numel() * 2
        out["loader_MBps"][n] = round(raw / (time.perf_counter() - t) / 1e6)
    return out


def run_layouts(args, tmp: Path) -> dict:
    x, offsets = load(args.store)
    y = without_repeats(x)
    data = {
        "store as it is": (x, offsets),
        "repeated rows dropped": (y, np.linspace(0, len(y), len(offsets)).astype(np.int64)),
    }
    result = {"store": args.store, "threads": args.threads, "results": {}}
    if args.wide_tokens:
        w = wide_states(store_tokens(args.store, args.wide_tokens), args.width)
        data["27B width (random-init forward)"] = (w, np.arange(0, len(w) + 1, 512 if len(w) > 512 else 64))
        result["writer"] = {"planes": writer_runs(w, "bf16", args.threads, tmp, args.store)}
        result["reader"] = {"planes": reader(tmp / "writer-bf16.zarr", sorted({1, args.threads}))}
        print("ShardWriter, ShardReader, 27B width:", result["writer"], result["reader"], file=sys.stderr)
    for label, (d, off) in data.items():
        print(f"== {label}: {d.shape}, {d.nbytes / 1e6:.1f} MB raw", file=sys.stderr)
        for name, codecs in layouts().items():
            result["results"].setdefault(label, {})[name] = measure(d, off, codecs, tmp, args.repeat)
    return result


def on_disk(path: str) -> dict:
    """The states' bytes in the store's commit records against raw bf16."""
    from store.hidden_store import HiddenStore

    store = HiddenStore(path)
    records = store.committed().values()
    raw = sum(r.tokens for r in records) * len(store.attrs.taps) * store.attrs.hidden_size * 2
    states = sum(r.bytes["hidden"] for r in records)
    return {
        "raw_MB": round(raw / 1e6, 2),
        "states_MB": round(states / 1e6, 2),
        "ratio": round(states / raw, 4),
        "shards_MB": round(sum(r.bytes["shard"] for r in records) / 1e6, 2),
    }


class Errors:
    """Per tap: max and mean |fp8 - bf16|, relative RMS, cosine, and where the largest error is."""

    def __init__(self, taps: int) -> None:
        self.abs_sum, self.sq_err, self.sq_ref, self.n = np.zeros(taps), np.zeros(taps), np.zeros(taps), 0
        self.dot, self.sq_q = np.zeros(taps), np.zeros(taps)
        self.max = np.zeros(taps)
        self.worst: list[dict | None] = [None] * taps

    def add(self, ref, q, where: dict) -> None:
        """ref, q: [T, n_taps, H] bf16 tensors."""
        x, y = ref.double(), q.double()
        e = (y - x).abs()
        self.abs_sum += e.sum((0, 2)).numpy()
        self.sq_err += (e**2).sum((0, 2)).numpy()
        self.sq_ref += (x**2).sum((0, 2)).numpy()
        self.sq_q += (y**2).sum((0, 2)).numpy()
        self.dot += (x * y).sum((0, 2)).numpy()
        self.n += e.shape[0] * e.shape[2]
        for j in range(e.shape[1]):
            m = float(e[:, j].max())
            if m > self.max[j]:
                t, c = divmod(int(e[:, j].argmax()), e.shape[2])
                self.max[j] = m
                self.worst[j] = {
                    **where,
                    "token": t,
                    "channel": c,
                    "value": float(x[t, j, c]),
                    "stored": float(y[t, j, c]),
                    "token_max_abs": float(x[t, j].abs().max()),
                }

    def result(self, taps) -> dict:
        return {
            str(k): {
                "max_abs": float(self.max[j]),
                "mean_abs": float(self.abs_sum[j] / self.n),
                "relative_rms": float(np.sqrt(self.sq_err[j] / self.sq_ref[j])),
                "cosine": float(self.dot[j] / np.sqrt(self.sq_ref[j] * self.sq_q[j])),
                "worst": self.worst[j],
            }
            for j, k in enumerate(taps)
        }


def shipped_errors(bf16: str, fp8: str) -> dict:
    import torch

    from store.format.fp8_codec import quantize
    from store.hidden_store import HiddenStore
    from store.shard_reader import ShardReader

    a, b = HiddenStore(bf16), HiddenStore(fp8)
    assert a.attrs.compat.as_format("fp8").conditioning() == b.attrs.compat.conditioning()
    errors, exact = Errors(len(a.attrs.taps)), True
    for shard in a.committed():
        ra, rb = ShardReader(a, shard), ShardReader(b, shard)
        for i in range(len(ra)):
            x, y = ra[i], rb[i]
            assert torch.equal(x.tokens, y.tokens)
            exact &= torch.equal(quantize(x.hidden), y.hidden)
            errors.add(x.hidden, y.hidden, {"shard": shard, "sample": i})
    return {"fp8_equals_rounded_bf16": bool(exact), "per_tap": errors.result(a.attrs.taps)}


def entropy(values: np.ndarray) -> float:
    counts = np.bincount(values.reshape(-1))
    p = counts[counts > 0] / values.size
    return float(-(p * np.log2(p)).sum())


def information(q) -> dict:
    """Order-0 entropy, in bits a value, of the e4m3 bytes' fields and of the scale exponents."""
    import torch

    from store.format.fp8_codec import exponents

    k = exponents(q.view(torch.int16))
    e4m3 = (q.float() * torch.exp2(-k.float())).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    fields = {
        "sign": entropy(e4m3 >> 7),
        "exponent": entropy((e4m3 >> 3) & 0xF),
        "mantissa": entropy(e4m3 & 7),
        "byte": entropy(e4m3),
    }
    fields["exponents_k_per_group"] = entropy((k.numpy() + 128).astype(np.int64))
    fields["floor_ratio"] = round(fields["byte"] / 16, 4)  # bits a value over bf16's 16
    fields["byte_per_tap"] = [entropy(e4m3[:, j]) for j in range(e4m3.shape[1])]  # each tap's own statistics
    fields["unique_rows_per_tap"] = [len(np.unique(e4m3[:, j], axis=0)) for j in range(e4m3.shape[1])]
    return fields


def decode_speed(q: np.ndarray, repeat: int) -> dict:
    """One 256-token chunk of rounded states: MB/s of raw bf16 out of its zstd frame and its lookup."""
    from store.format.fp8_codec import Fp8E4m3

    codec = Fp8E4m3(group=q.shape[-1])
    chunk = np.ascontiguousarray(q[:256])
    data = np.frombuffer(codec.pack(chunk.view(np.uint8)), np.uint8)
    buf, out = np.empty(chunk.size, np.uint8), np.empty((chunk.size // q.shape[-1], q.shape[-1]), np.uint16)
    codes, ks = codec.codes(data, into=buf)
    unzstd = timed(lambda: codec.codes(data, into=buf), 5 * repeat)
    lookup = timed(lambda: codec.decode_codes(codes, ks, out=out), 5 * repeat)
    return {
        "zstd_MBps": round(chunk.nbytes / unzstd / 1e6),
        "lookup_MBps": round(chunk.nbytes / lookup / 1e6),
        "decode_MBps": round(chunk.nbytes / (unzstd + lookup) / 1e6),
    }


def direct_read(bits: np.ndarray, codecs: list, tmp: Path, repeat: int) -> int:
    """MB/s (raw bf16) of store/span_reader.py reading the whole array into one reused buffer, as a
    training batch is decoded into (a fresh 100 MB output each time would measure its page faults)."""
    import fsspec
    import zarr

    from store import span_reader

    a = zarr.create_array(
        str(tmp / "direct.zarr"),
        shape=bits.shape,
        dtype=np.uint16,
        chunks=(256, *bits.shape[1:]),
        shards=(len(bits), *bits.shape[1:]),
        compressors=codecs,
        fill_value=0,
        overwrite=True,
    )
    a[:] = bits
    reader_ = span_reader.for_array(fsspec.filesystem("file"), str(tmp / "direct.zarr"), a)
    out = np.empty_like(bits)
    seconds = timed(lambda: reader_.read(0, len(bits), out), 2 * repeat + 1)
    assert np.array_equal(out, bits)
    return round(bits.nbytes / seconds / 1e6)


def wide_fp8(tokens: np.ndarray, width: int, tmp: Path, root: str, repeat: int) -> dict:
    from zarr.codecs import Crc32cCodec

    from store.format import layout
    from store.format.fp8_codec import Fp8E4m3, quantize

    bits = wide_states(tokens, width)  # [T, 5, width] uint16
    x = layout.from_bits(bits)
    q = quantize(x)
    rounding = timed(lambda: quantize(x), repeat)
    errors = Errors(x.shape[1])
    errors.add(x, q, {})
    qbits = layout.to_bits(q)
    offsets = np.arange(0, len(bits) + 1, 512 if len(bits) > 512 else 64)
    H = x.shape[2]
    out = {
        "shape": list(x.shape),
        "raw_MB": round(bits.nbytes / 1e6, 1),
        "quantize_MBps": round(bits.nbytes / rounding / 1e6),
        "per_tap": errors.result(range(x.shape[1])),
        "information": information(q),
        "decode": decode_speed(qbits, repeat),
        "zarr": {
            "bf16 (planes zstd-1 / lz4)": measure(bits, offsets, lambda: layout.hidden_codecs(1), tmp, repeat),
            "fp8 (e4m3 x 2^k, zstd-1)": measure(
                qbits, offsets, lambda: [Fp8E4m3(group=H, level=1), Crc32cCodec()], tmp, repeat
            ),
        },
        "direct_read_into_a_buffer_MBps": {
            "bf16": direct_read(bits, layout.hidden_codecs(1), tmp, repeat),
            "fp8": direct_read(qbits, [Fp8E4m3(group=H), Crc32cCodec()], tmp, repeat),
        },
    }
    for fmt, data in (("bf16", bits), ("fp8", qbits)):
        out.setdefault("writer", {})[fmt] = {f"{n} thread(s)": writer_runs(data, fmt, n, tmp, root) for n in (1, 2)}
        out.setdefault("reader", {})[fmt] = reader(tmp / f"writer-{fmt}.zarr", [1])
        print(fmt, out["writer"][fmt], out["reader"][fmt], file=sys.stderr)
    return out


def run_fp8(args, tmp: Path) -> dict:
    t0 = time.time()
    result = {
        "bf16": args.bf16,
        "fp8": args.fp8,
        "shipped": {
            "on_disk": {"bf16": on_disk(args.bf16), "fp8": on_disk(args.fp8)},
            **shipped_errors(args.bf16, args.fp8),
        },
    }
    print(result["shipped"]["on_disk"], file=sys.stderr)
    if args.wide_tokens:
        tokens = store_tokens(args.bf16, args.wide_tokens)
        result["27B width (random-init forward)"] = wide_fp8(tokens, args.width, tmp, args.bf16, args.repeat)
    result["seconds"] = round(time.time() - t0)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    s = harness.subcommand(sub, "layouts", "bf16 layouts side by side: size, write and read speed, random sample reads")
    s.add_argument("--store", required=True)
    f = harness.subcommand(sub, "fp8", "the fp8 format against bf16: size, rounding error, write and read speed")
    f.add_argument("--bf16", required=True, help="a bf16 store")
    f.add_argument("--fp8", required=True, help="the fp8 store of the same prompts")
    for q in (s, f):
        q.add_argument("--wide-tokens", type=int, default=2048, help="tokens of 27B-width states (0: none)")
    args = harness.parse(p)
    import numcodecs.blosc

    harness.torch_setup(args.threads)
    numcodecs.blosc.set_nthreads(1)
    args.repeat, args.width = (1, TOY_H) if args.toy else (3, WIDE_H)
    if args.toy:
        args.wide_tokens = min(args.wide_tokens, 256)
    with tempfile.TemporaryDirectory() as tmp:
        result = (run_layouts if args.cmd == "layouts" else run_fp8)(args, Path(tmp))
    harness.emit(result, args)


if __name__ == "__main__":
    main()

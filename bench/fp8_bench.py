"""The fp8 hidden format against bf16: size, the error of the rounding, write and read speed.

    pipeline extract --store bf16.zarr --shards 0-63
    pipeline extract --store fp8.zarr --shards 0-63 --hidden-format fp8
    python bench/fp8_bench.py --bf16 bf16.zarr --fp8 fp8.zarr [--wide-tokens 2048] [--json bench/results/fp8_cpu.json]

Two kinds of data. The shipped target's stores of the same prompts in both formats: the states'
bytes on disk (commit records) against raw bf16, and the round trip's error per tap (max and mean
absolute, relative RMS, and the worst token) between the two stores' states. States of Qwen3.6-27B's
shape ([T, 5, 5120], bench/store_bench.py's random-initialised forward on the store's tokens; its
first layers barely mix context, so rows repeat where the prompts' template does, which zstd finds:
`unique_rows_per_tap` says how many): the same error figures, the size of each layout written through zarr with the store's chunking, the
information in the e4m3 bytes (order-0 entropy of sign, exponent and mantissa fields: what a coder
without context can reach), one core's speed of the rounding (as the capture runs it on CPU), of
zarr's write and of the direct reader (store/span_reader.py, what training uses), and the
extractor's ShardWriter with one and two threads, as fast as it takes and fed at 500 MB/s (an H200 capturing
at 27B width). Best of 3 per speed; MB/s are of raw bf16 states.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ["ZARR_THREADING__MAX_WORKERS"] = "1"  # one core's worth (zarr sizes its pool at first use)

import numpy as np  # noqa: E402
import torch  # noqa: E402
from zarr.codecs import Crc32cCodec  # noqa: E402

from bench.report import emit  # noqa: E402
from bench.store_bench import best, measure, reader, wide_states, writer  # noqa: E402
from store import layout, span_reader  # noqa: E402
from store.fp8_codec import Fp8E4m3, quantize  # noqa: E402
from store.hidden_store import HiddenStore  # noqa: E402
from store.shard_reader import ShardReader  # noqa: E402


def on_disk(path: str) -> dict:
    """The states' bytes in the store's commit records against raw bf16."""
    store = HiddenStore(path)
    records = store.committed().values()
    raw = sum(r.tokens for r in records) * len(store.attrs.taps) * store.attrs.hidden_size * 2
    states = sum(r.bytes["hidden"] for r in records)
    return {"raw_MB": round(raw / 1e6, 2), "states_MB": round(states / 1e6, 2), "ratio": round(states / raw, 4),
            "shards_MB": round(sum(r.bytes["shard"] for r in records) / 1e6, 2)}


class Errors:
    """Per tap: max and mean |fp8 - bf16|, relative RMS, cosine, and where the largest error is."""

    def __init__(self, taps: int) -> None:
        self.abs_sum, self.sq_err, self.sq_ref, self.n = np.zeros(taps), np.zeros(taps), np.zeros(taps), 0
        self.dot, self.sq_q = np.zeros(taps), np.zeros(taps)
        self.max = np.zeros(taps)
        self.worst: list[dict | None] = [None] * taps

    def add(self, ref: torch.Tensor, q: torch.Tensor, where: dict) -> None:
        """ref, q: [T, n_taps, H] bf16."""
        x, y = ref.double(), q.double()
        e = (y - x).abs()
        self.abs_sum += e.sum((0, 2)).numpy()
        self.sq_err += (e ** 2).sum((0, 2)).numpy()
        self.sq_ref += (x ** 2).sum((0, 2)).numpy()
        self.sq_q += (y ** 2).sum((0, 2)).numpy()
        self.dot += (x * y).sum((0, 2)).numpy()
        self.n += e.shape[0] * e.shape[2]
        for j in range(e.shape[1]):
            m = float(e[:, j].max())
            if m > self.max[j]:
                t, c = divmod(int(e[:, j].argmax()), e.shape[2])
                self.max[j] = m
                self.worst[j] = {**where, "token": t, "channel": c, "value": float(x[t, j, c]),
                                 "stored": float(y[t, j, c]), "token_max_abs": float(x[t, j].abs().max())}

    def result(self, taps) -> dict:
        return {str(k): {"max_abs": float(self.max[j]), "mean_abs": float(self.abs_sum[j] / self.n),
                         "relative_rms": float(np.sqrt(self.sq_err[j] / self.sq_ref[j])),
                         "cosine": float(self.dot[j] / np.sqrt(self.sq_ref[j] * self.sq_q[j])),
                         "worst": self.worst[j]} for j, k in enumerate(taps)}


def shipped_errors(bf16: str, fp8: str) -> dict:
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


def information(q: torch.Tensor) -> dict:
    """Order-0 entropy, in bits a value, of the e4m3 bytes' fields and of the scale exponents."""
    from store.fp8_codec import exponents

    k = exponents(q.view(torch.int16))
    e4m3 = (q.float() * torch.exp2(-k.float())).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    fields = {"sign": entropy(e4m3 >> 7), "exponent": entropy((e4m3 >> 3) & 0xF), "mantissa": entropy(e4m3 & 7),
              "byte": entropy(e4m3)}
    fields["exponents_k_per_group"] = entropy((k.numpy() + 128).astype(np.int64))
    fields["floor_ratio"] = round(fields["byte"] / 16, 4)  # bits a value over bf16's 16
    fields["byte_per_tap"] = [entropy(e4m3[:, j]) for j in range(e4m3.shape[1])]  # each tap's own statistics
    fields["unique_rows_per_tap"] = [len(np.unique(e4m3[:, j], axis=0)) for j in range(e4m3.shape[1])]
    return fields


def decode_speed(q: np.ndarray) -> dict:
    """One 256-token chunk of rounded states: MB/s of raw bf16 out of its zstd frame and its lookup."""
    codec = Fp8E4m3(group=q.shape[-1])
    chunk = np.ascontiguousarray(q[:256])
    data = np.frombuffer(codec.pack(chunk.view(np.uint8)), np.uint8)
    buf, out = np.empty(chunk.size, np.uint8), np.empty((chunk.size // q.shape[-1], q.shape[-1]), np.uint16)
    codes, ks = codec.codes(data, into=buf)
    unzstd = best(lambda: codec.codes(data, into=buf), 15)
    lookup = best(lambda: codec.decode_codes(codes, ks, out=out), 15)
    return {"zstd_MBps": round(chunk.nbytes / unzstd / 1e6), "lookup_MBps": round(chunk.nbytes / lookup / 1e6),
            "decode_MBps": round(chunk.nbytes / (unzstd + lookup) / 1e6)}


def direct_read(bits: np.ndarray, codecs: list, tmp: Path) -> int:
    """MB/s (raw bf16) of store/span_reader.py reading the whole array into one reused buffer, as a
    training batch is decoded into (a fresh 100 MB output each time would measure its page faults)."""
    import fsspec
    import zarr

    a = zarr.create_array(str(tmp / "direct.zarr"), shape=bits.shape, dtype=np.uint16, chunks=(256, *bits.shape[1:]),
                          shards=(len(bits), *bits.shape[1:]), compressors=codecs, fill_value=0, overwrite=True)
    a[:] = bits
    reader_ = span_reader.for_array(fsspec.filesystem("file"), str(tmp / "direct.zarr"), a)
    out = np.empty_like(bits)
    seconds = best(lambda: reader_.read(0, len(bits), out), 7)
    assert np.array_equal(out, bits)
    return round(bits.nbytes / seconds / 1e6)


def wide(tokens: np.ndarray, tmp: Path, root: str) -> dict:
    bits = wide_states(tokens)  # [T, 5, 5120] uint16
    x = layout.from_bits(bits)
    q = quantize(x)
    rounding = best(lambda: quantize(x))
    errors = Errors(x.shape[1])
    errors.add(x, q, {})
    qbits = layout.to_bits(q)
    offsets = np.arange(0, len(bits) + 1, 512)
    H = x.shape[2]
    out = {"shape": list(x.shape), "raw_MB": round(bits.nbytes / 1e6, 1),
           "quantize_MBps": round(bits.nbytes / rounding / 1e6),
           "per_tap": errors.result(range(x.shape[1])), "information": information(q), "decode": decode_speed(qbits),
           "zarr": {"bf16 (planes zstd-1 / lz4)": measure(bits, offsets, lambda: layout.hidden_codecs(1), tmp),
                    "fp8 (e4m3 x 2^k, zstd-1)": measure(qbits, offsets,
                                                        lambda: [Fp8E4m3(group=H, level=1), Crc32cCodec()], tmp)},
           "direct_read_into_a_buffer_MBps": {"bf16": direct_read(bits, layout.hidden_codecs(1), tmp),
                                              "fp8": direct_read(qbits, [Fp8E4m3(group=H), Crc32cCodec()], tmp)}}
    for fmt, data in (("bf16", bits), ("fp8", qbits)):
        out.setdefault("writer", {})[fmt] = {
            f"{n} thread(s)": {"as fast as it takes": writer(data, fmt, n, tmp),
                               "at 500 MB/s": writer(data, fmt, n, tmp, producer_mb_s=500, root=root)}
            for n in (1, 2)}
        out.setdefault("reader", {})[fmt] = reader(tmp / f"writer-{fmt}.zarr", [1])
        print(fmt, out["writer"][fmt], out["reader"][fmt], file=sys.stderr)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--bf16", required=True, help="a bf16 store")
    p.add_argument("--fp8", required=True, help="the fp8 store of the same prompts")
    p.add_argument("--wide-tokens", type=int, default=2048, help="tokens of 27B-width states (0: none)")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    torch.set_num_threads(1)
    t0 = time.time()
    result = {"bf16": args.bf16, "fp8": args.fp8,
              "shipped": {"on_disk": {"bf16": on_disk(args.bf16), "fp8": on_disk(args.fp8)},
                          **shipped_errors(args.bf16, args.fp8)}}
    print(result["shipped"]["on_disk"], file=sys.stderr)
    if args.wide_tokens:
        store = HiddenStore(args.bf16)
        tokens = np.concatenate([store.shard_arrays(s)["tokens"][:] for s in store.committed()])[:args.wide_tokens]
        with tempfile.TemporaryDirectory() as tmp:
            result["27B width (random-init forward)"] = wide(tokens, Path(tmp), args.bf16)
    result["seconds"] = round(time.time() - t0)
    emit(result, args.json)


if __name__ == "__main__":
    main()

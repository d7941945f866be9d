"""Extraction benchmark on the shipped tiny target (a measurement, not a test).

    python bench/extract_bench.py --shards 0-7 --dtype bf16 --repeat 3

Reports, per repeat and as medians: tokens/s of the extraction loop, the share of loop time
outside the model (generate + capture forward), time the model thread waited on the writer,
bytes per token, compression ratio against raw bf16, and writer throughput. Then compares
lossless codecs on the states just written. Prints markdown; --json writes the raw figures.
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

import numpy as np  # noqa: E402
import torch  # noqa: E402

from stages.extract.config import ExtractConfig  # noqa: E402
from stages.extract.run import run  # noqa: E402


def one_run(args, store: Path) -> dict:
    config = ExtractConfig(store=str(store), shards=args.shards, dtype=args.dtype, device=args.device,
                           batch_size=args.batch_size, max_new_tokens=args.max_new_tokens, max_length=args.max_length)
    s = run(config, log=lambda m: None)
    t = s["timing"]
    model_s = t["generate_s"] + t["capture_s"]
    raw = s["hidden_bytes_raw_bf16"]
    return {
        "samples": s["samples"], "tokens": s["tokens"], "wall_s": s["wall_s"], "loop_s": t["loop_s"],
        "loop_tokens_per_s": s["tokens"] / t["loop_s"],
        "generate_s": t["generate_s"], "capture_s": t["capture_s"], "prepare_s": t["prepare_s"],
        "non_model_share": 1 - model_s / t["loop_s"],
        "stall_s": t["stall_s"], "writer_busy_s": t["writer_busy_s"],
        "writer_mb_per_s": raw / 1e6 / t["writer_busy_s"] if t["writer_busy_s"] else None,
        "bytes_per_token_stored": s["hidden_bytes_on_disk"] / s["tokens"],
        "bytes_per_token_raw": raw / s["tokens"],
        "compression_ratio": s["compression_ratio"],
        "store_bytes": s["bytes_on_disk"],
    }


def codec_table(store: Path) -> list[dict]:
    """Ratio and single-thread compress speed of candidate lossless codecs on stored states."""
    import numcodecs
    import zarr

    numcodecs.blosc.set_nthreads(1)
    root = zarr.open_group(str(store), mode="r")
    shard = sorted(root["shards"].group_keys())[0]
    bits = root[f"shards/{shard}/hidden"][:]
    chunk = 256
    pieces = [np.ascontiguousarray(bits[i:i + chunk]) for i in range(0, len(bits) - chunk + 1, chunk)] or [bits]
    raw = sum(p.nbytes for p in pieces)
    out = []
    for name, codec in [
        ("blosc zstd-1 byteshuffle", numcodecs.Blosc("zstd", 1, numcodecs.Blosc.SHUFFLE)),
        ("blosc zstd-3 byteshuffle (default)", numcodecs.Blosc("zstd", 3, numcodecs.Blosc.SHUFFLE)),
        ("blosc zstd-5 byteshuffle", numcodecs.Blosc("zstd", 5, numcodecs.Blosc.SHUFFLE)),
        ("blosc zstd-3 bitshuffle", numcodecs.Blosc("zstd", 3, numcodecs.Blosc.BITSHUFFLE)),
        ("blosc lz4-5 byteshuffle", numcodecs.Blosc("lz4", 5, numcodecs.Blosc.SHUFFLE)),
        ("zstd-3 no shuffle", numcodecs.Zstd(3)),
    ]:
        t = time.perf_counter()
        enc = [codec.encode(p) for p in pieces]
        dt = time.perf_counter() - t
        size = sum(len(e) for e in enc)
        t = time.perf_counter()
        for e, p in zip(enc, pieces):
            assert np.array_equal(np.frombuffer(codec.decode(e), dtype=np.uint16).reshape(p.shape), p)
        dd = time.perf_counter() - t
        out.append({"codec": name, "ratio": raw / size, "compress_mb_s": raw / 1e6 / dt, "decompress_mb_s": raw / 1e6 / dd})
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shards", default="0-7", help="shards of the shipped prompt set (64 in all)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-length", type=int, default=1024)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    p.add_argument("--json", type=Path, default=None, help="write the raw figures here")
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeat):
            runs.append(one_run(args, Path(tmp) / f"hs{r}.zarr"))
        codecs = codec_table(Path(tmp) / "hs0.zarr")
    med = {k: statistics.median(r[k] for r in runs) for k in runs[0] if isinstance(runs[0][k], (int, float))}
    print(f"# extract benchmark: {' '.join(sys.argv[1:]) or '(defaults)'}; {os.cpu_count()} CPUs, "
          f"torch threads {torch.get_num_threads()}, device {args.device}, dtype {args.dtype}\n")
    print("| figure | median | runs |\n| --- | --- | --- |")
    for k in ("samples", "tokens", "loop_tokens_per_s", "loop_s", "generate_s", "capture_s", "prepare_s",
              "non_model_share", "stall_s", "writer_busy_s", "writer_mb_per_s", "bytes_per_token_raw",
              "bytes_per_token_stored", "compression_ratio", "wall_s"):
        print(f"| {k} | {med[k]:.4g} | {', '.join(f'{r[k]:.4g}' for r in runs)} |")
    print("\n| codec (on stored states, 256-token chunks, 1 thread) | ratio | compress MB/s | decompress MB/s |")
    print("| --- | --- | --- | --- |")
    for c in codecs:
        print(f"| {c['codec']} | {c['ratio']:.3f} | {c['compress_mb_s']:.0f} | {c['decompress_mb_s']:.0f} |")
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)}, "runs": runs, "median": med,
                                         "codecs": codecs}, indent=1))


if __name__ == "__main__":
    main()

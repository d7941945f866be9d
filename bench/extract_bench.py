"""Extraction benchmark on the shipped tiny target (a measurement, not a test).

    python -m bench.extract_bench --shards 0-7 --dtype bf16 --repeat 3 --threads 2 [--json bench/results/cpu_bf16.json]
    python -m bench.extract_bench --shards 0-7 --dtype fp32 --repeat 3 --threads 2 [--json bench/results/cpu_fp32.json]
    python -m bench.extract_bench --shards 0-7 --dtype bf16 --repeat 3 [--json bench/results/cpu_bf16_1thread.json]
    python -m bench.extract_bench --device cuda --shards 0-7 --repeat 1      # bench/gpu_check.sh

Reports, per repeat and as medians: tokens/s of the extraction loop, the share of loop time
outside the model (generate + capture forward), time the model thread waited on the writer,
bytes per token, compression ratio against raw bf16, and writer throughput. Then compares
lossless codecs on the states just written (ratio, compress and decompress MB/s, one thread).
--toy: shard 0, 32 new tokens, one repeat.
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

from bench import harness

TOY = [["--shards", "0"]]
CODECS = [
    ("blosc zstd-1 byteshuffle", "zstd", 1, "SHUFFLE"),
    ("blosc zstd-3 byteshuffle (default)", "zstd", 3, "SHUFFLE"),
    ("blosc zstd-5 byteshuffle", "zstd", 5, "SHUFFLE"),
    ("blosc zstd-3 bitshuffle", "zstd", 3, "BITSHUFFLE"),
    ("blosc lz4-5 byteshuffle", "lz4", 5, "SHUFFLE"),
    ("zstd-3 no shuffle", None, 3, None),
]


def one_run(args, store: Path) -> dict:
    from stages.extract.config import ExtractConfig
    from stages.extract.run import run

    config = ExtractConfig(
        store=str(store),
        shards=args.shards,
        dtype=args.dtype,
        device=args.device,
        batch_size=args.batch_size,
        max_new_tokens=args.max_new_tokens,
        max_length=args.max_length,
    )
    s = run(config, log=lambda m: None)
    t = s["timing"]
    model_s = t["generate_s"] + t["capture_s"]
    raw = s["hidden_bytes_raw_bf16"]
    return {
        "samples": s["samples"],
        "tokens": s["tokens"],
        "wall_s": s["wall_s"],
        "loop_s": t["loop_s"],
        "loop_tokens_per_s": s["tokens"] / t["loop_s"],
        "generate_s": t["generate_s"],
        "capture_s": t["capture_s"],
        "prepare_s": t["prepare_s"],
        "non_model_share": 1 - model_s / t["loop_s"],
        "stall_s": t["stall_s"],
        "writer_busy_s": t["writer_busy_s"],
        "writer_mb_per_s": raw / 1e6 / t["writer_busy_s"] if t["writer_busy_s"] else None,
        "bytes_per_token_stored": s["hidden_bytes_on_disk"] / s["tokens"],
        "bytes_per_token_raw": raw / s["tokens"],
        "compression_ratio": s["compression_ratio"],
        "store_bytes": s["bytes_on_disk"],
    }


def codec_table(store: Path) -> list[dict]:
    """Ratio and single-thread compress speed of candidate lossless codecs on stored states."""
    import numcodecs
    import numpy as np
    import zarr

    numcodecs.blosc.set_nthreads(1)
    root = zarr.open_group(str(store), mode="r")
    shard = sorted(root["shards"].group_keys())[0]
    bits = root[f"shards/{shard}/hidden"][:]
    chunk = 256
    pieces = [np.ascontiguousarray(bits[i : i + chunk]) for i in range(0, len(bits) - chunk + 1, chunk)] or [bits]
    raw = sum(p.nbytes for p in pieces)
    out = []
    for name, cname, level, shuffle in CODECS:
        codec = numcodecs.Blosc(cname, level, getattr(numcodecs.Blosc, shuffle)) if cname else numcodecs.Zstd(level)
        t = time.perf_counter()
        enc = [codec.encode(p) for p in pieces]
        dt = time.perf_counter() - t
        t = time.perf_counter()
        for e, p in zip(enc, pieces):
            assert np.array_equal(np.frombuffer(codec.decode(e), dtype=p.dtype).reshape(p.shape), p)
        dd = time.perf_counter() - t
        out.append(
            {
                "codec": name,
                "ratio": raw / sum(len(e) for e in enc),
                "compress_mb_s": raw / 1e6 / dt,
                "decompress_mb_s": raw / 1e6 / dd,
            }
        )
    return out


def main() -> None:
    p = harness.parser(__doc__)
    p.add_argument("--shards", default="0-7", help="shards of the shipped prompt set (64 in all)")
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    p.add_argument("--device", default="cpu")
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--max-length", type=int, default=1024)
    p.add_argument("--repeat", type=int, default=3)
    args = harness.parse(p)
    if args.toy:
        args.max_new_tokens, args.max_length, args.batch_size, args.repeat = 32, 256, 4, 1
    harness.torch_setup(args.threads)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.repeat):
            runs.append(one_run(args, Path(tmp) / f"hs{r}.zarr"))
        codecs = codec_table(Path(tmp) / "hs0.zarr")
    med = {k: harness.median_of(r[k] for r in runs) for k in runs[0] if isinstance(runs[0][k], (int, float))}
    harness.emit({"args": vars(args), "cpus": os.cpu_count(), "runs": runs, "median": med, "codecs": codecs}, args)


if __name__ == "__main__":
    main()

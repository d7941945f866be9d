"""Training straight from an object store with a per-request latency, against the same run without it:
train.py's steps/s through moto's S3 server behind the latency proxy (tools/s3/latency_proxy.py).

    pipeline extract --store /tmp/t32.zarr --shards 0-31          # the tiny target, 320 prompts
    python bench/s3_train.py --store /tmp/t32.zarr --json bench/results/s3_train.json

The store is copied into moto once; then train.py runs --steps steps in the README's setting (4 rows of
64 anchors, 2 loader workers, one thread) at each --delays latency, each run reading the store through
a fresh proxy that counts its requests. Each run's s/step is the median over its metrics records
after the first (start-up, first reads, loader warm-up), so steady training is compared, as a
production run spends its hours; the requests are the run's total. Issue 38's goal: with the latency
at which serial reads would take ~3x the step (300 ms at the tiny width), at least 0.8x the steps/s
of the run without it. moto and the proxy share the machine's 2 cores with the trainer.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SETTING = ["--batch-size", "4", "--anchors", "64", "--threads", "1", "--workers", "2", "--log-every", "5",
           "--save-every", "0", "--eval-replay-prompts", "0"]


def run(url: str, out: Path, steps: int, delay_ms: int, server, extra: list[str]) -> dict:
    from tools.s3.latency_proxy import LatencyProxy

    proxy = LatencyProxy(server.url, delay_ms / 1000).start()
    env = {**os.environ, **server.env, "FSSPEC_S3_ENDPOINT_URL": proxy.url, "OMP_NUM_THREADS": "1"}
    try:
        p = subprocess.run([sys.executable, "train.py", "--store", url, "--out", str(out), "--max-steps", str(steps),
                            *SETTING, *extra], cwd=ROOT, env=env, capture_output=True, text=True)
    finally:
        proxy.stop()
    if p.returncode:
        raise RuntimeError(p.stderr[-3000:])
    recs = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    times = [r["time"] for r in recs if r["split"] == "train"]
    per_step = [(b - a) / 5 for a, b in zip(times, times[1:])]  # --log-every 5
    return {"delay_ms": delay_ms, "steps": steps, "s_per_step": round(statistics.median(per_step), 3),
            "s_per_step_windows": [round(x, 3) for x in per_step], "requests": proxy.requests,
            "requests_per_sample": round(proxy.requests / (steps * 4), 2), "bytes": proxy.bytes}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store", type=Path, required=True, help="a local store to copy into moto")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--delays", default="0,300", help="latencies per request, ms")
    p.add_argument("--extra", default="", help="more train.py flags, space-separated (e.g. --cache-dir ...)")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    from bench.s3_bench import upload
    from tests.s3 import serving

    url = "s3://bench/train.zarr"
    rows = []
    with tempfile.TemporaryDirectory() as tmp, serving(Path(tmp) / "moto.log", "bench") as server:
        upload(str(args.store), url, None)
        for delay in map(int, args.delays.split(",")):
            row = run(url, Path(tmp) / f"run-{delay}", args.steps, delay, server, args.extra.split())
            rows.append(row)
            print(json.dumps(row), flush=True)
    base = rows[0]["s_per_step"]
    out = {"store": str(args.store), "setting": SETTING, "extra": args.extra, "runs": rows,
           "steps_per_s_ratio": {r["delay_ms"]: round(base / r["s_per_step"], 3) for r in rows}}
    print(json.dumps(out["steps_per_s_ratio"]))
    if args.json:
        args.json.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()

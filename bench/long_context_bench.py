"""Training memory against --max-length, with and without --grad-checkpoint, at the tiny width on CPU.

    python bench/long_context_bench.py --like hs.zarr --store /tmp/long.zarr [--lengths 1024,2048,4096,8192] \\
        [--json bench/results/long_context_cpu.json]

Builds (once) a store with the root of --like and 8 samples of each length in --lengths (64 prompt
tokens, the rest completion; random tokens and states: memory does not depend on their values),
then for each length and each setting runs train.py's setup and 3 steps in a fresh process
(--max-length that length, --batch-size 1, --workers 0, the default drafter and 512 anchors) and
reports its peak resident memory and the seconds of the whole run (setup, 3 steps, the validations
before the first step and at the end). The samples of a length are its own
shard, trained alone.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
PROMPT, SAMPLES = 64, 8

CHILD = """
import json, resource, sys, time
sys.path.insert(0, {root!r})
from stages.train.config import TrainConfig
from stages.train.run import run
config = TrainConfig(store={store!r}, out={out!r}, shards={shard!r}, max_length={length}, batch_size=1, workers=0,
                     max_steps=3, threads=2, grad_checkpoint={ckpt}, eval_every=0, save_every=0, log_every=1)
t = time.perf_counter()
run(config, log=lambda m: None)
print("RESULT", json.dumps({{"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                            "s": time.perf_counter() - t}}))
"""


def build(location: str, like: str, lengths: list[int]) -> None:
    import torch

    from pipeline import fingerprint
    from store.hidden_store import HiddenStore
    from store.schema import to_json
    from store.shard_writer import ShardWriter
    from store.store_writer import StoreWriter

    src = HiddenStore(like)
    compat = dataclasses.replace(src.attrs.compat, num_shards=len(lengths))
    attrs = dataclasses.replace(src.attrs, num_shards=len(lengths), compat=compat,
                                fingerprint=fingerprint.sha256_json(to_json(compat)))
    store = StoreWriter(location)
    store.create_or_check(attrs, src.embedding("embed_tokens"), src.embedding("lm_head"))
    g = torch.Generator().manual_seed(0)
    for shard, n in enumerate(lengths):
        if store.commit_record(shard) is not None:
            continue
        w = ShardWriter(store, shard, len(attrs.taps), attrs.hidden_size, chunk_tokens=attrs.layout.chunk_tokens,
                        shard_tokens=attrs.layout.shard_tokens)
        for i in range(SAMPLES):
            ids = torch.randint(5, attrs.vocab_size - 8, (n,), generator=g).tolist()
            w.add(shard * SAMPLES + i, ids[:PROMPT], ids[PROMPT:], truncated=False)
        w.add_hidden(torch.randn(SAMPLES * n, len(attrs.taps), attrs.hidden_size, generator=g).to(torch.bfloat16))
        w.commit(None, run={})


def measure(store: str, shard: int, length: int, ckpt: bool) -> dict:
    with tempfile.TemporaryDirectory() as out:
        script = Path(out) / "child.py"
        script.write_text(CHILD.format(root=str(ROOT), store=store, out=f"{out}/run", shard=str(shard), length=length,
                                       ckpt=ckpt))
        p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True)
        if p.returncode:
            raise SystemExit(p.stderr[-3000:])
    result = json.loads(next(line for line in p.stdout.splitlines() if line.startswith("RESULT"))[7:])
    return {"max_length": length, "grad_checkpoint": ckpt, "peak_rss_mb": round(result["peak_rss_mb"]),
            "run_s": round(result["s"], 1)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--like", required=True)
    p.add_argument("--store", required=True)
    p.add_argument("--lengths", default="1024,2048,4096,8192")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    lengths = [int(x) for x in args.lengths.split(",")]
    build(args.store, args.like, lengths)
    rows = [measure(args.store, shard, n, ckpt) for shard, n in enumerate(lengths) for ckpt in (False, True)]
    print("| --max-length | --grad-checkpoint | peak RSS MB | s (setup, 3 steps, 2 validations) |\n|---|---|---|---|")
    for r in rows:
        print(f"| {r['max_length']} | {'on' if r['grad_checkpoint'] else 'off'} | {r['peak_rss_mb']} | {r['run_s']} |")
    if args.json:
        args.json.write_text(json.dumps({"samples_per_length": SAMPLES, "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()

"""Replay against live speculative decoding: rounds/s and tokens/s (a measurement, not a test).

    python bench/eval_bench.py --store hs.zarr --checkpoint runs/curve/final --shards 56-63 --prompts 20 --repeat 3

Replays the chain drafter over the first --prompts prompts of --shards from the store, then runs the
same prompts live with the store's target (verify in one pass, roll back on rejection), and the
target alone (greedy, same cache code). Reports medians over --repeat runs, in one process.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


from bench.report import emit  # noqa: E402
from pipeline import device as devices  # noqa: E402
from pipeline.decode import live  # noqa: E402
from pipeline.target import loading  # noqa: E402
from pipeline.target.verifier import LiveTarget  # noqa: E402
from stages.evaluate.conditioning import build, check_checkpoint  # noqa: E402
from stages.evaluate.prompts import Prompts  # noqa: E402
from store.hidden_store import HiddenStore  # noqa: E402
from store.ranges import parse_ranges  # noqa: E402
from tests.pipeline.decode import reference_replay as replay  # noqa: E402


def timed(fn, items) -> tuple[float, list]:
    t = time.perf_counter()
    out = [fn(x) for x in items]
    return time.perf_counter() - t, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store", default="hs.zarr")
    p.add_argument("--checkpoint", required=True)
    p.add_argument("--target", default=None, help="[default: the target recorded in the store]")
    p.add_argument("--shards", default="0-63")
    p.add_argument("--prompts", type=int, default=20)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--json", default=None)
    args = p.parse_args()
    devices.prepare_cpu(args.threads)
    store = HiddenStore(args.store)
    attrs = store.attrs
    ck = check_checkpoint(args.checkpoint, store, False, [])
    m = build(ck, store.embedding("embed_tokens"), store.embedding("lm_head"), args.device, args.dtype)
    prompts = Prompts(store, parse_ranges(args.shards, store.num_shards), None, seed=0)
    samples = list(prompts.read(prompts.refs[:args.prompts]))
    t = loading.load(args.target or attrs.target.path, args.device, attrs.dtype, "auto")
    lt = LiveTarget(t, list(attrs.taps))
    eos = set(attrs.eos_token_ids)

    def limit(s):
        return attrs.compat.completion_limit(s.prompt_len)

    runs = {"replay": [], "live": [], "target_only": []}
    for _ in range(args.repeat):
        dt, reps = timed(lambda s: replay.replay(m, s), samples)
        runs["replay"].append((dt, sum(len(r.rounds) for r in reps), sum(sum(t for _, t in r.rounds) for r in reps)))
        dt, lives = timed(lambda s: live.speculative(m, lt, s.tokens[:s.prompt_len], limit(s), eos), samples)
        runs["live"].append((dt, sum(len(r.rounds) for r in lives), sum(len(r.tokens) - 1 for r in lives)))
        dt, base = timed(lambda s: live.greedy(lt, s.tokens[:s.prompt_len], limit(s), eos), samples)
        runs["target_only"].append((dt, sum(len(r.tokens) - 1 for r in base), sum(len(r.tokens) - 1 for r in base)))
    res = {"prompts": len(samples), "threads": args.threads, "device": args.device, "dtype": args.dtype,
           "repeat": args.repeat}
    for name, rs in runs.items():
        res[name] = {"rounds_per_s": statistics.median(r / d for d, r, _ in rs),
                     "tokens_per_s": statistics.median(k / d for d, _, k in rs),
                     "seconds": statistics.median(d for d, _, _ in rs), "rounds": rs[0][1], "tokens": rs[0][2]}
    res["replay_over_live_rounds_per_s"] = res["replay"]["rounds_per_s"] / res["live"]["rounds_per_s"]
    res["live_speedup_over_target_only"] = res["live"]["tokens_per_s"] / res["target_only"]["tokens_per_s"]
    emit(res, args.json)


if __name__ == "__main__":
    main()

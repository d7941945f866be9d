"""Serial against batched replay: lane-rounds per second, and the same rounds (a measurement, not a test).

    python bench/replay_bench.py --store hs.zarr --checkpoint runs/a/final --prompts 64 --slots 1,8,32

Serial is the one-prompt reference (tests/pipeline/decode/reference_replay.py: one DraftSession per prompt and
policy, a forward and a host sync per round). Batched is what evaluate.py runs
(pipeline/decode/batch_replay.py: context K/V once per prompt shared by every policy, --slots
prompts per forward, one device-to-host copy per round). Both replay chain + DDTree-8/16/32/64 over
the same prompts; a lane-round is one policy's round of one prompt. Medians of --repeat runs in one
process; also checks that every prompt got the same rounds both ways (fp32), how many prompts
got the same rounds in bf16 as in fp32 (batched), tau per dtype, and the host's share of a
batched round (acceptance and the DDTree search) per lane-round.

    python bench/replay_bench.py --width 1024 --vocab 32768 --prompts 16 --slots 1,16

Without a store: a random drafter of that hidden size (the default sizes for it, 5 layers) and
random states and tokens, to see how batching pays when the drafter's weights, not the Python
around them, dominate a round.
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
from pipeline.decode.batch_replay import BatchReplay  # noqa: E402
from stages.evaluate.conditioning import build, check_checkpoint  # noqa: E402
from stages.evaluate.prompts import Prompts  # noqa: E402
from store.hidden_store import HiddenStore  # noqa: E402
from store.ranges import parse_ranges  # noqa: E402
from tests.pipeline.decode import reference_replay as replay  # noqa: E402

BUDGETS = (8, 16, 32, 64)


def serial(m, samples) -> tuple[float, dict]:
    t = time.perf_counter()
    policies = [replay.chain, *(replay.tree(b) for b in BUDGETS)]
    out = {(s.shard, s.index): [len(replay.replay(m, s, p).rounds) for p in policies] for s in samples}
    return time.perf_counter() - t, out


def batched(m, samples, slots: int) -> tuple[float, dict, float, dict]:
    """-> (seconds, rounds per policy by prompt, seconds of host acceptance, tau per policy by prompt)."""
    engine = BatchReplay(m, BUDGETS, slots, max(len(s.tokens) for s in samples))
    host, accept = [0.0], engine._accepted

    def timed_accept(*a):  # the host's share of a round: acceptance and the DDTree search
        t0 = time.perf_counter()
        out = accept(*a)
        host[0] += time.perf_counter() - t0
        return out

    engine._accepted = timed_accept
    t = time.perf_counter()
    counts = list(engine.run(samples))
    seconds = time.perf_counter() - t
    taus = {(c.shard, c.index): [c.tau(lane) for lane in range(1 + len(BUDGETS))] for c in counts}
    return seconds, {(c.shard, c.index): c.rounds for c in counts}, host[0], taus


def mean_tau(taus: dict, lane: int) -> float:
    """tau of one policy: the mean over prompts with a round of their tokens per round."""
    values = [t[lane] for t in taus.values() if t[lane] == t[lane]]  # NaN: no round
    return sum(values) / len(values)


def synthetic(width: int, vocab: int, n: int, length: int = 96):
    """A random drafter of hidden size `width` and n random samples of `length` tokens (prompt 32)."""
    import torch

    from pipeline.drafter.config import DrafterConfig, default_sizes
    from pipeline.drafter.model import Drafter
    from store.shard_reader import Sample

    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)  # the drafter's own initialisation too: the same lane-rounds every run
    sizes = default_sizes(width)
    dc = DrafterConfig(hidden_size=width, vocab_size=vocab, block_size=16, mask_token_id=vocab - 1,
                       target_layer_ids=(1, 2, 3, 4, 5), num_target_layers=8,
                       layer_types=("full_attention",) * sizes["num_hidden_layers"], **sizes)
    embed = (torch.randn(vocab, width, generator=g) * 0.02).bfloat16()
    m = Drafter(dc, embed, (torch.randn(vocab, width, generator=g) * 0.02).bfloat16())
    mask = torch.zeros(length, dtype=torch.bool)
    mask[32:] = True
    samples = [Sample(shard=0, index=i, row_id=i, tokens=torch.randint(0, vocab - 1, (length,), generator=g),
                      loss_mask=mask, prompt_len=32, hidden=torch.randn(length, 5, width, generator=g).bfloat16())
               for i in range(n)]
    return m, samples


class Released:
    """A drafter made in memory, in the shape conditioning.build expects of a loaded checkpoint."""

    def __init__(self, m) -> None:
        self.config, self.tensors = m.config, {k: v.bfloat16() for k, v in m.state_dict().items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--store", default="hs.zarr")
    p.add_argument("--checkpoint", help="a trained drafter (with --store; not with --width)")
    p.add_argument("--shards", default="0-63")
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--slots", default="1,8,32")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--device", default="cpu")
    p.add_argument("--width", type=int, default=None, help="synthetic: the drafter's hidden size (no store)")
    p.add_argument("--vocab", type=int, default=32768, help="synthetic: the vocabulary")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    if args.device == "cpu":
        devices.prepare_cpu(args.threads)
    if args.width:
        m0, samples = synthetic(args.width, args.vocab, args.prompts)
        ck, embed, lm_head = Released(m0), m0.embed_tokens, m0.lm_head
    else:
        store = HiddenStore(args.store)
        ck = check_checkpoint(args.checkpoint, store, True, [])
        prompts = Prompts(store, parse_ranges(args.shards, store.num_shards), args.prompts, seed=0)
        samples = list(prompts.read(prompts.refs))
        embed, lm_head = store.embedding("embed_tokens"), store.embedding("lm_head")
    res = {"prompts": len(samples), "tokens": sum(len(s.tokens) for s in samples), "threads": args.threads,
           "device": args.device,
           "budgets": BUDGETS, "repeat": args.repeat, "width": ck.config.hidden_size, "vocab": ck.config.vocab_size}
    last = {}  # per dtype: the last --slots setting's first run
    for dtype in ("fp32", "bf16"):
        m = build(ck, embed, lm_head, args.device, dtype)
        runs = {"serial": [serial(m, samples) for _ in range(args.repeat)]}
        for k in map(int, args.slots.split(",")):
            runs[f"batched-{k}"] = [batched(m, samples, k) for _ in range(args.repeat)]
        ref = runs["serial"][0][1]
        lane_rounds = sum(sum(r) for r in ref.values())
        for name, rs in runs.items():
            res[f"{dtype}/{name}"] = {"seconds": statistics.median(r[0] for r in rs),
                                      "lane_rounds_per_s": statistics.median(sum(sum(x) for x in r[1].values()) / r[0]
                                                                             for r in rs),
                                      "prompts_with_serial_rounds": sum(rs[0][1][k] == ref[k] for k in ref)}
            if name != "serial":
                res[f"{dtype}/{name}"]["host_us_per_lane_round"] = statistics.median(r[2] for r in rs) / lane_rounds * 1e6
        res[f"{dtype}/lane_rounds"] = lane_rounds
        last[dtype] = runs[f"batched-{args.slots.split(',')[-1]}"][0]
        res[f"{dtype}/tau"] = [mean_tau(last[dtype][3], lane) for lane in range(1 + len(BUDGETS))]  # chain, budgets
    a, b = last["fp32"][1], last["bf16"][1]
    res["prompts_with_equal_rounds_bf16_fp32"] = sum(a[k] == b[k] for k in a)
    res["prompts_with_equal_chain_rounds_bf16_fp32"] = sum(a[k][0] == b[k][0] for k in a)
    emit(res, args.json)


if __name__ == "__main__":
    main()

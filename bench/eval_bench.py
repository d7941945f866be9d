"""Evaluation benchmarks (measurements, not tests): replay against live speculative decoding, and
serial against batched replay.

    python -m bench.eval_bench live --store hs.zarr --checkpoint runs/curve/final --shards 56-63 --prompts 20 \\
        --repeat 3 [--json bench/results/eval_cpu.json]
    python -m bench.eval_bench replay --store hs.zarr --checkpoint runs/a/final --prompts 64 --slots 1,8,32 \\
        [--json bench/results/replay_cpu.json]
    python -m bench.eval_bench replay --width 1024 --vocab 32768 --prompts 16 --slots 1,16
    python -m bench.eval_bench replay --device cuda --width 2048 --vocab 65536 --prompts 4 --slots 1,4 --repeat 1

Both take the same prompts (--prompts of --shards, drawn as evaluate.py draws them, seed 0) and the
same conditioning (the checkpoint checked against the store and built as evaluate.py builds it).

`live`: replays the chain drafter over the prompts, then runs them live with the store's target
(verify in one pass, roll back on rejection), and the target alone (greedy, same cache code).
Rounds/s and tokens/s, medians over --repeat runs in one process.

`replay`: serial is the one-prompt reference (tests/pipeline/decode/reference_replay.py: one
DraftSession per prompt and policy, a forward and a host sync per round). Batched is what
evaluate.py runs (pipeline/decode/batch_replay.py: context K/V once per prompt shared by every
policy, --slots prompts per forward, one device-to-host copy per round). Both replay chain +
DDTree-8/16/32/64 over the same prompts; a lane-round is one policy's round of one prompt. Medians
of --repeat runs in one process; also checks that every prompt got the same rounds both ways (fp32),
how many prompts got the same rounds in bf16 as in fp32 (batched), tau per dtype, and the host's
share of a batched round (acceptance and the DDTree search) per lane-round. With --width instead of
a store: a random drafter of that hidden size (the default sizes for it, 5 layers) and random states
and tokens, to see how batching pays when the drafter's weights, not the Python around them,
dominate a round.

--toy: one repeat.
"""

from __future__ import annotations

import argparse
import time

from bench import harness

TOY = [
    ["live", "--store", "{store}", "--checkpoint", "{checkpoint}", "--shards", "3", "--prompts", "2"],
    [
        "replay",
        "--store",
        "{store}",
        "--checkpoint",
        "{checkpoint}",
        "--shards",
        "3",
        "--prompts",
        "2",
        "--slots",
        "1,2",
    ],
    ["replay", "--width", "64", "--vocab", "512", "--prompts", "2", "--slots", "1,2"],
]
BUDGETS = (8, 16, 32, 64)


def conditioned(args, allow_mismatch: bool):
    """The checkpoint checked against the store, the store's embeddings, and the prompts (both benches'
    conditioning) -> (checked checkpoint, embed_tokens, lm_head, samples, store)."""
    from stages.evaluate.conditioning import check_checkpoint
    from stages.evaluate.prompts import Prompts
    from store.format.ranges import parse_ranges
    from store.hidden_store import HiddenStore

    store = HiddenStore(args.store)
    ck = check_checkpoint(args.checkpoint, store, allow_mismatch, [])
    prompts = Prompts(store, parse_ranges(args.shards, store.num_shards), args.prompts, seed=0)
    samples = list(prompts.read(prompts.refs))
    return ck, store.embedding("embed_tokens"), store.embedding("lm_head"), samples, store


def timed(fn, items) -> tuple[float, list]:
    t = time.perf_counter()
    out = [fn(x) for x in items]
    return time.perf_counter() - t, out


def live(args) -> dict:
    from pipeline.decode import live as decode
    from pipeline.target import loading
    from pipeline.target.verifier import LiveTarget
    from stages.evaluate.conditioning import build
    from tests.pipeline.decode import reference_replay as replay

    ck, embed, lm_head, samples, store = conditioned(args, False)
    attrs = store.attrs
    m = build(ck, embed, lm_head, args.device, args.dtype)
    lt = LiveTarget(loading.load(args.target or attrs.target.path, args.device, attrs.dtype, "auto"), list(attrs.taps))
    eos = set(attrs.eos_token_ids)

    def limit(s):
        return attrs.compat.completion_limit(s.prompt_len)

    runs = {"replay": [], "live": [], "target_only": []}
    for _ in range(args.repeat):
        dt, reps = timed(lambda s: replay.replay(m, s), samples)
        runs["replay"].append((dt, sum(len(r.rounds) for r in reps), sum(sum(t for _, t in r.rounds) for r in reps)))
        dt, lives = timed(lambda s: decode.speculative(m, lt, s.tokens[: s.prompt_len], limit(s), eos), samples)
        runs["live"].append((dt, sum(len(r.rounds) for r in lives), sum(len(r.tokens) - 1 for r in lives)))
        dt, base = timed(lambda s: decode.greedy(lt, s.tokens[: s.prompt_len], limit(s), eos), samples)
        runs["target_only"].append((dt, sum(len(r.tokens) - 1 for r in base), sum(len(r.tokens) - 1 for r in base)))
    res = {
        "prompts": len(samples),
        "threads": args.threads,
        "device": args.device,
        "dtype": args.dtype,
        "repeat": args.repeat,
    }
    for name, rs in runs.items():
        res[name] = {
            "rounds_per_s": harness.median_of(r / d for d, r, _ in rs),
            "tokens_per_s": harness.median_of(k / d for d, _, k in rs),
            "seconds": harness.median_of(d for d, _, _ in rs),
            "rounds": rs[0][1],
            "tokens": rs[0][2],
        }
    res["replay_over_live_rounds_per_s"] = res["replay"]["rounds_per_s"] / res["live"]["rounds_per_s"]
    res["live_speedup_over_target_only"] = res["live"]["tokens_per_s"] / res["target_only"]["tokens_per_s"]
    return res


def serial(m, samples) -> tuple[float, dict]:
    from tests.pipeline.decode import reference_replay as replay

    t = time.perf_counter()
    policies = [replay.chain, *(replay.tree(b) for b in BUDGETS)]
    out = {(s.shard, s.index): [len(replay.replay(m, s, p).rounds) for p in policies] for s in samples}
    return time.perf_counter() - t, out


def batched(m, samples, slots: int) -> tuple[float, dict, float, dict]:
    """-> (seconds, rounds per policy by prompt, seconds of host acceptance, tau per policy by prompt)."""
    from pipeline.decode.batch_replay import BatchReplay

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
    dc = DrafterConfig(
        hidden_size=width,
        vocab_size=vocab,
        block_size=16,
        mask_token_id=vocab - 1,
        target_layer_ids=(1, 2, 3, 4, 5),
        num_target_layers=8,
        layer_types=("full_attention",) * sizes["num_hidden_layers"],
        **sizes,
    )
    embed = (torch.randn(vocab, width, generator=g) * 0.02).bfloat16()
    m = Drafter(dc, embed, (torch.randn(vocab, width, generator=g) * 0.02).bfloat16())
    mask = torch.zeros(length, dtype=torch.bool)
    mask[32:] = True
    samples = [
        Sample(
            shard=0,
            index=i,
            row_id=i,
            tokens=torch.randint(0, vocab - 1, (length,), generator=g),
            loss_mask=mask,
            prompt_len=32,
            hidden=torch.randn(length, 5, width, generator=g).bfloat16(),
        )
        for i in range(n)
    ]
    return m, samples


class Released:
    """A drafter made in memory, in the shape conditioning.build expects of a loaded checkpoint."""

    def __init__(self, m) -> None:
        self.config, self.tensors = m.config, {k: v.bfloat16() for k, v in m.state_dict().items()}


def replay_bench(args) -> dict:
    from stages.evaluate.conditioning import build

    if args.width:
        m0, samples = synthetic(args.width, args.vocab, args.prompts)
        ck, embed, lm_head = Released(m0), m0.embed_tokens, m0.lm_head
    else:
        ck, embed, lm_head, samples, _ = conditioned(args, True)
    res = {
        "prompts": len(samples),
        "tokens": sum(len(s.tokens) for s in samples),
        "threads": args.threads,
        "device": args.device,
        "budgets": BUDGETS,
        "repeat": args.repeat,
        "width": ck.config.hidden_size,
        "vocab": ck.config.vocab_size,
    }
    last = {}  # per dtype: the last --slots setting's first run
    for dtype in ("fp32", "bf16"):
        m = build(ck, embed, lm_head, args.device, dtype)
        runs = {"serial": [serial(m, samples) for _ in range(args.repeat)]}
        for k in map(int, args.slots.split(",")):
            runs[f"batched-{k}"] = [batched(m, samples, k) for _ in range(args.repeat)]
        ref = runs["serial"][0][1]
        lane_rounds = sum(sum(r) for r in ref.values())
        for name, rs in runs.items():
            res[f"{dtype}/{name}"] = {
                "seconds": harness.median_of(r[0] for r in rs),
                "lane_rounds_per_s": harness.median_of(sum(sum(x) for x in r[1].values()) / r[0] for r in rs),
                "prompts_with_serial_rounds": sum(rs[0][1][k] == ref[k] for k in ref),
            }
            if name != "serial":
                res[f"{dtype}/{name}"]["host_us_per_lane_round"] = (
                    harness.median_of(r[2] for r in rs) / lane_rounds * 1e6
                )
        res[f"{dtype}/lane_rounds"] = lane_rounds
        last[dtype] = runs[f"batched-{args.slots.split(',')[-1]}"][0]
        res[f"{dtype}/tau"] = [mean_tau(last[dtype][3], lane) for lane in range(1 + len(BUDGETS))]  # chain, budgets
    a, b = last["fp32"][1], last["bf16"][1]
    res["prompts_with_equal_rounds_bf16_fp32"] = sum(a[k] == b[k] for k in a)
    res["prompts_with_equal_chain_rounds_bf16_fp32"] = sum(a[k][0] == b[k][0] for k in a)
    return res


def subcommand(subs, name: str, help: str) -> argparse.ArgumentParser:
    """A subcommand with the harness's shared flags (--json, --force, --toy, --threads), and the
    store, checkpoint and prompts both benches take."""
    s = harness.subcommand(subs, name, help)
    s.add_argument("--store", default="hs.zarr")
    s.add_argument("--checkpoint", help="a trained drafter of the store (not with --width)")
    s.add_argument("--shards", default="0-63")
    s.add_argument("--repeat", type=int, default=3)
    s.add_argument("--device", default="cpu")
    return s


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    subs = p.add_subparsers(dest="cmd", required=True)
    lv = subcommand(subs, "live", "replay against live speculative decoding and the target alone")
    lv.add_argument("--prompts", type=int, default=20)
    lv.add_argument("--target", default=None, help="[default: the target recorded in the store]")
    lv.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    rp = subcommand(subs, "replay", "serial against batched replay, chain and DDTree")
    rp.add_argument("--prompts", type=int, default=64)
    rp.add_argument("--slots", default="1,8,32")
    rp.add_argument("--width", type=int, default=None, help="synthetic: the drafter's hidden size (no store)")
    rp.add_argument("--vocab", type=int, default=32768, help="synthetic: the vocabulary")
    args = harness.parse(p)
    if args.toy:
        args.repeat = 1
    if args.device == "cpu":
        harness.torch_setup(args.threads)
    harness.emit(live(args) if args.cmd == "live" else replay_bench(args), args)


if __name__ == "__main__":
    main()

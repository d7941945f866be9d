"""Evaluate drafters by replaying greedy speculative decoding from the store.

For each checkpoint: load it strictly and check its conditioning against the store (checks.py),
replay every stored prompt of the chosen shards (chain drafting and DDTree-N for each budget), and
write the report (report.py).
"""

from __future__ import annotations

from pathlib import Path

from tqdm import tqdm

from pipeline import device as devices
from pipeline.decode import replay
from pipeline.decode.acceptance import summarize
from pipeline.drafter.model import Drafter
from stages.evaluate import report
from stages.evaluate.checks import build, choose_shards, load_checked
from stages.evaluate.config import EvalConfig
from stages.evaluate.prompts import Prompts
from store.errors import StoreError
from store.hidden_store import HiddenStore
from store.ranges import format_ranges


def evaluate_one(m: Drafter, samples, config: EvalConfig, label: str) -> tuple[dict, list]:
    """Chain replay and one DDTree replay per budget over all samples -> (results, chain rounds)."""
    policies = {"chain": replay.chain, **{f"ddtree-{b}": replay.tree(b) for b in config.ddtree}}
    per_policy = {name: [] for name in policies}
    for s in tqdm(samples, total=len(samples), desc=f"replay {label}", unit="prompt", disable=None):
        for name, policy in policies.items():
            per_policy[name].append(replay.replay(m, s, policy, config.max_rounds))
    B = m.config.block_size
    chain = per_policy["chain"]
    out = {**summarize([p.rounds for p in chain], B), "block_size": B}
    trees = {str(b): summarize([p.rounds for p in per_policy[f"ddtree-{b}"]], B) for b in config.ddtree}
    out["ddtree"] = {b: t["tau"] for b, t in trees.items()}
    out["ddtree_pooled"] = {b: t["tau_pooled"] for b, t in trees.items()}
    out["per_prompt"] = [{"shard": p.shard, "index": p.index, "row_id": p.row_id, "prompt_len": p.prompt_len,
                          "completion_len": p.completion_len, "rounds": len(p.rounds), "tau": p.tau,
                          "ddtree": {str(b): per_policy[f"ddtree-{b}"][i].tau for b in config.ddtree}}
                         for i, p in enumerate(chain)]
    return out, chain


def run(config: EvalConfig, log=print) -> dict:
    if config.device == "cpu":
        devices.prepare_cpu(config.threads)
    store = HiddenStore(config.store)
    warnings: list[str] = []
    loaded = [load_checked(p, store, config.allow_mismatch, warnings) for p in config.checkpoints]
    shards = choose_shards(config, store, loaded, warnings)
    for w in warnings:
        log(f"warning: {w}")
    embed, lm_head = store.embedding("embed_tokens"), store.embedding("lm_head")
    samples = Prompts(store, shards, config.max_prompts)
    if not samples:
        raise StoreError(f"{config.store}: shards {format_ranges(shards)} hold no prompt with a completion")
    bench = None
    if config.live:
        from stages.evaluate.live import LiveBench, open_target

        bench = LiveBench(open_target(config.target, store.attrs, config.device, config.allow_mismatch, warnings),
                          samples, store.attrs)
    results = []
    for i, x in enumerate(loaded):
        m = build(x, embed, lm_head, config.device)
        res, chain = evaluate_one(m, samples, config, Path(x.path).name or x.path)
        if bench is not None:
            res["live"] = bench.run(m, chain, _name(x.path, i))
        results.append({"name": _name(x.path, i), "path": x.path, "check": x.check,
                        "train_shards": x.record.train_shards if x.record else None,
                        "step": x.record.step if x.record else None, **res})
    rep = report.build(config, store.attrs, format_ranges(shards), warnings, results)
    report.write(rep, Path(config.out))
    return rep


def _name(path: str, i: int) -> str:
    p = Path(path).resolve()
    return f"{p.parent.name}/{p.name}" if p.parent.name else f"checkpoint-{i}"

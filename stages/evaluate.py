"""Evaluate drafters by replaying greedy speculative decoding from the store.

For each checkpoint: load it strictly, check its conditioning against the store (our checkpoints
carry the store fingerprint; a released one is checked on what it carries: taps, hidden size,
vocabulary, mask token), replay every stored prompt of the chosen shards (chain drafting and
DDTree-N for each budget), and write the report (pipeline/report.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from pipeline import checkpoint, replay
from pipeline.acceptance import summarize
from pipeline.drafter import Drafter
from pipeline.drafter_config import DrafterConfig, store_mismatches
from pipeline.errors import PipelineError
from pipeline.ranges import format_ranges, parse_ranges
from store.hidden_store import HiddenStore
from store.shard_reader import ShardReader


@dataclass(frozen=True)
class EvalConfig:
    store: str = "hs.zarr"
    checkpoints: tuple[str, ...] = ()
    shards: str | None = None  # None: the checkpoint's held-out shards if it recorded them, else all
    ddtree: tuple[int, ...] = (8, 16, 32, 64)  # node budgets
    out: str = "report"
    max_rounds: int | None = None  # per prompt
    max_prompts: int | None = None
    allow_mismatch: bool = False
    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    threads: int = 1  # CPU intra-op threads: replay is many tiny ops; more threads help little and crawl under load
    live: bool = False  # also run real speculative decoding with the target
    target: str | None = None  # the store's target, for --live

    def validate(self) -> None:
        if not self.checkpoints:
            raise PipelineError("--checkpoint: give at least one drafter checkpoint directory")
        if any(b < 1 for b in self.ddtree):
            raise PipelineError(f"--ddtree {','.join(map(str, self.ddtree))}: budgets must be at least 1")
        if self.live and not self.target:
            raise PipelineError("--live needs --target DIR (the store's target model)")
        for name in ("max_rounds", "max_prompts"):
            if getattr(self, name) is not None and getattr(self, name) < 1:
                raise PipelineError(f"--{name.replace('_', '-')} {getattr(self, name)}: must be at least 1")


@dataclass
class Loaded:
    path: str
    config: DrafterConfig
    tensors: dict
    extra: dict  # our provenance block ({} for a released checkpoint)
    check: str  # how the conditioning was checked, for the report


def load_checked(path: str, attrs: dict, allow_mismatch: bool, warnings: list[str]) -> Loaded:
    config, tensors, extra = checkpoint.load(path)
    diff = store_mismatches(config, attrs)
    shape = [f"{label}: checkpoint has {diff[k][0]}, store has {diff[k][1]}" for k, label in
             (("hidden_size", "hidden_size"), ("vocab_size", "vocab_size"), ("num_taps", "number of taps")) if k in diff]
    if shape:
        raise PipelineError(f"{path} cannot run on {attrs.get('_location', 'the store')}: " + "; ".join(shape))
    problems = [f"{label}: checkpoint {diff[k][0]}, store {diff[k][1]}" for k, label in
                (("taps", "taps"), ("mask_token_id", "mask token")) if k in diff]
    fp = extra.get("store_fingerprint")
    if fp is not None and fp != attrs["fingerprint"]:
        problems.append(f"store fingerprint: trained on {fp[:12]}, this store is {attrs['fingerprint'][:12]} "
                        "(different target, taps, backend, tokenizer or data)")
    if problems and not allow_mismatch:
        raise PipelineError(f"{path} was not trained on this store's conditioning ({'; '.join(problems)}); "
                            "pass --allow-mismatch to evaluate anyway")
    if problems:
        warnings.append(f"MISMATCH allowed for {path}: " + "; ".join(problems))
        check = "mismatch (allowed): " + "; ".join(problems)
    elif fp is None:
        check = "released checkpoint: taps, hidden size, vocabulary and mask token match; store fingerprint not checked"
        warnings.append(f"{path} carries no store fingerprint (a released checkpoint): only taps, hidden size, "
                        "vocabulary and mask token were checked")
    else:
        check = "store fingerprint matches"
    return Loaded(path, config, tensors, extra, check)


def choose_shards(config: EvalConfig, store: HiddenStore, loaded: list[Loaded], warnings: list[str]) -> list[int]:
    n = store.num_shards
    committed = sorted(store.committed())
    if config.shards:
        ids = parse_ranges(config.shards, n)
    else:
        recorded = [x.extra.get("eval_shards") for x in loaded if x.extra.get("eval_shards")]
        ids = parse_ranges(recorded[0], n) if recorded else committed
        if len(set(recorded)) > 1:
            warnings.append(f"checkpoints recorded different held-out shards {sorted(set(recorded))}; using {recorded[0]}")
    missing = [s for s in ids if s not in committed]
    if missing:
        raise PipelineError(f"{store.location}: shards {format_ranges(missing)} are not committed")
    if not ids:
        raise PipelineError(f"{store.location}: no committed shards to evaluate")
    for x in loaded:
        trained = x.extra.get("train_shards")
        overlap = sorted(set(ids) & set(parse_ranges(trained, n))) if trained else []
        if overlap:
            warnings.append(f"{x.path} was trained on shards {format_ranges(overlap)}, which are evaluated here")
    return ids


def build(loaded: Loaded, embed, lm_head, device: str) -> Drafter:
    m = Drafter(loaded.config, embed.float(), lm_head.float())
    checkpoint.load_into(m, loaded.tensors)
    return m.to(device).eval()


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


class Prompts:
    """The stored prompts to replay, read one at a time (a store's held-out shards may not fit in
    memory): every sample with a completion, in shard order, the first `limit` when given."""

    def __init__(self, store: HiddenStore, shards: list[int], limit: int | None) -> None:
        self.store, self.refs, self._readers = store, [], {}
        for shard in shards:
            g = store.shard_arrays(shard)
            offsets, mask = g["offsets"][:], g["loss_mask"][:]
            self.refs += [(shard, i) for i in range(len(offsets) - 1) if mask[offsets[i]:offsets[i + 1]].any()]
        self.refs = self.refs[:limit]

    def __len__(self) -> int:
        return len(self.refs)

    def __iter__(self):
        for shard, i in self.refs:
            if shard not in self._readers:
                self._readers = {shard: ShardReader(self.store, shard)}  # one shard's tokens at a time
            yield self._readers[shard][i]


def run(config: EvalConfig, log=print) -> dict:
    from pipeline import report

    config.validate()
    if config.device == "cpu":
        torch.set_flush_denormal(True)
        torch.set_num_threads(config.threads)
    store = HiddenStore(config.store)
    attrs = {**store.attrs, "_location": config.store}
    warnings: list[str] = []
    loaded = [load_checked(p, attrs, config.allow_mismatch, warnings) for p in config.checkpoints]
    shards = choose_shards(config, store, loaded, warnings)
    for w in warnings:
        log(f"warning: {w}")
    embed, lm_head = store.embedding("embed_tokens"), store.embedding("lm_head")
    samples = Prompts(store, shards, config.max_prompts)
    if not samples:
        raise PipelineError(f"{config.store}: shards {format_ranges(shards)} hold no prompt with a completion")
    bench = None
    if config.live:
        from stages.live_eval import LiveBench, open_target

        bench = LiveBench(open_target(config.target, attrs, config.device, config.allow_mismatch, warnings), samples,
                          attrs)
    results = []
    for i, x in enumerate(loaded):
        m = build(x, embed, lm_head, config.device)
        res, chain = evaluate_one(m, samples, config, Path(x.path).name or x.path)
        if bench is not None:
            res["live"] = bench.run(m, chain, _name(x.path, i))
        results.append({"name": _name(x.path, i), "path": x.path, "check": x.check,
                        "train_shards": x.extra.get("train_shards"), "step": x.extra.get("step"), **res})
    rep = report.build(config, attrs, format_ranges(shards), warnings, results)
    report.write(rep, Path(config.out))
    return rep


def _name(path: str, i: int) -> str:
    p = Path(path).resolve()
    return f"{p.parent.name}/{p.name}" if p.parent.name else f"checkpoint-{i}"

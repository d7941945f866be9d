"""`evaluate.py --live --target DIR`: real speculative decoding with the target on the same prompts.

The target must be the store's own (same fingerprint) and runs in the store's dtype on the same
kind of device, so its greedy tokens are the stored ones. Per checkpoint it reports live tau, tokens
per second against target-only greedy decoding with the same cache code, and how many prompts
accepted exactly the same tokens, round by round, as replay.
"""

from __future__ import annotations

from tqdm import tqdm

from pipeline.decode import live
from pipeline.decode.acceptance import summarize
from pipeline.errors import TargetError
from pipeline.target import loading
from pipeline.target.verifier import LiveTarget
from store.format.schema import StoreAttrs


def open_target(path: str, attrs: StoreAttrs, device: str, allow_mismatch: bool, warnings: list[str]):
    t = loading.load(path, device, attrs.dtype, "auto")
    mine, theirs = t.record.fingerprint, attrs.target.fingerprint
    if mine != theirs:
        msg = f"--target {path} is not the store's target (fingerprint {mine[:12]}, store has {theirs[:12]})"
        if not allow_mismatch:
            raise TargetError(msg + "; pass --allow-mismatch to run it anyway")
        warnings.append("MISMATCH allowed: " + msg)
    return t


class LiveBench:
    """Target-only greedy decoding once per prompt (the baseline), then speculative per drafter."""

    def __init__(self, target, samples, attrs: StoreAttrs) -> None:
        self.lt = LiveTarget(target, list(attrs.taps))
        self.samples = samples
        self.compat = attrs.compat
        self.eos = set(attrs.eos_token_ids)
        runs = [
            live.greedy(self.lt, s.tokens[: s.prompt_len], self.limit(s), self.eos)
            for s in tqdm(samples, total=len(samples), desc="target-only greedy", unit="prompt", disable=None)
        ]
        self.base_tokens = sum(len(r.tokens) for r in runs)
        self.base_seconds = sum(r.seconds for r in runs)

    def limit(self, sample) -> int:
        return self.compat.completion_limit(sample.prompt_len)

    def run(self, drafter, replayed: list[list[tuple[int, int]]], label: str) -> dict:
        """replayed: the chain replay's rounds of the same samples, to compare with."""
        runs, same, stored = [], 0, 0
        for s, rep in tqdm(
            zip(self.samples, replayed), total=len(replayed), desc=f"live {label}", unit="prompt", disable=None
        ):
            r = live.speculative(drafter, self.lt, s.tokens[: s.prompt_len], self.limit(s), self.eos)
            runs.append(r)
            same += r.rounds == rep
            stored += r.tokens == s.tokens[s.prompt_len :].tolist()
        seconds, tokens = sum(r.seconds for r in runs), sum(len(r.tokens) for r in runs)
        stats = summarize([r.rounds for r in runs], drafter.config.block_size)
        return {
            "tau": stats["tau"],
            "tau_pooled": stats["tau_pooled"],
            "rounds": stats["rounds"],
            "tokens_per_s": tokens / seconds,
            "target_only_tokens_per_s": self.base_tokens / self.base_seconds,
            "speedup": (tokens / seconds) / (self.base_tokens / self.base_seconds),
            "prompts": len(runs),
            "prompts_equal_to_replay": same,
            "completions_equal_to_store": stored,
        }

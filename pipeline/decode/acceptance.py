"""Acceptance: how many drafted tokens greedy verification keeps, and the tau statistics.

One round drafts slots 1..B-1 after the last committed token; the target's greedy tokens verify
them; the leading drafts equal to the target's tokens are accepted and the target adds one token
of its own (the bonus). Tokens per round = accepted + 1, cut to what is left to generate.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

# Context-length buckets of a round (its context: the tokens up to and including the block's start),
# as tau is reported per bucket: < 1k, 1k-4k, 4k-16k, >= 16k tokens.
CONTEXT_EDGES = (1024, 4096, 16384)
CONTEXT_LABELS = ("<1k", "1k-4k", "4k-16k", ">=16k")


def context_bucket(start: int) -> int:
    """The bucket of a round whose block starts at position `start` (its context: start + 1 tokens)."""
    return sum(start + 1 >= edge for edge in CONTEXT_EDGES)


def accepted(drafts: Sequence[int], target: Sequence[int]) -> int:
    """Leading drafts equal to the target's greedy tokens (compared only as far as both go)."""
    n = 0
    for d, t in zip(drafts, target):
        if int(d) != int(t):
            break
        n += 1
    return n


def round_tokens(acc: int, remaining: int) -> int:
    """Tokens a round commits: the accepted drafts plus the bonus, cut to the tokens left."""
    return min(acc + 1, remaining)


def summarize(prompts: list[list[tuple[int, int]]], block_size: int) -> dict:
    """prompts: per prompt, its rounds as (accepted drafts, tokens committed) -> `stats`."""
    hist = [0] * block_size
    for acc, _ in (r for p in prompts for r in p):
        hist[min(acc, block_size - 1)] += 1
    return stats([(len(p), sum(t for _, t in p)) for p in prompts], hist)


def stats(per_prompt: list[tuple[int, int]], hist: list[int]) -> dict:
    """The tau statistics from counts: per_prompt: (rounds, tokens committed) of each prompt, in a
    fixed order; hist: rounds by accepted drafts 0..B-1.

    tau and tau_ci95: `tau_over_prompts`; tau_pooled: all tokens / all rounds; per_slot[k-1]: share
    of rounds whose k-th draft was accepted, k = 1..B-1."""
    n, tokens = sum(hist), sum(t for _, t in per_prompt)
    over = tau_over_prompts(per_prompt)
    return {
        "tau": over["tau"],
        "tau_ci95": over["tau_ci95"],
        "tau_pooled": tokens / n if n else float("nan"),
        "histogram": list(hist),
        "per_slot": [sum(hist[k:]) / n if n else float("nan") for k in range(1, len(hist))],
        "rounds": n,
        "prompts": over["prompts"],
        "tokens": tokens,
    }


def tau_over_prompts(per_prompt: list[tuple[int, int]]) -> dict:
    """THE tau of a set of prompts, per_prompt (rounds, tokens committed) of each: tau, the mean over
    the prompts (with a round) of each prompt's mean tokens per round (the DFlash convention, bonus
    counted), and tau_ci95, its 95% interval over prompts (`ci95` of the per-prompt means). Every
    report's tau, chain and DDTree, whole sample and per group, is this function's."""
    means = [t / r for r, t in per_prompt if r]
    tau = sum(means) / len(means) if means else float("nan")
    return {"prompts": len(means), "rounds": sum(r for r, _ in per_prompt), "tau": tau, "tau_ci95": ci95(means, tau)}


def ci95(values: list[float], mean: float) -> list[float] | None:
    """[low, high]: mean +- 1.96 standard errors of the values (None below 2 values). The values are
    per-prompt taus, taken as a sample of the prompts the drafter will meet: the interval says how far
    tau could move with other prompts like these. It is not shrunk to a point when every prompt of a
    store was replayed (a store's prompts are themselves a sample)."""
    n = len(values)
    if n < 2:
        return None
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1))
    half = 1.96 * sd / math.sqrt(n)
    return [mean - half, mean + half]

"""Acceptance: how many drafted tokens greedy verification keeps, and the tau statistics.

One round drafts slots 1..B-1 after the last committed token; the target's greedy tokens verify
them; the leading drafts equal to the target's tokens are accepted and the target adds one token
of its own (the bonus). Tokens per round = accepted + 1, cut to what is left to generate.
"""

from __future__ import annotations

from collections.abc import Sequence


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
    """prompts: per prompt, its rounds as (accepted drafts, tokens committed).

    tau: mean over prompts of each prompt's mean tokens per round (the DFlash convention, bonus
    counted); tau_pooled: all tokens / all rounds; histogram: rounds by accepted drafts 0..B-1;
    per_slot[k-1]: share of rounds whose k-th draft was accepted (acc >= k), k = 1..B-1."""
    rounds = [r for p in prompts for r in p]
    means = [sum(t for _, t in p) / len(p) for p in prompts if p]
    hist = [0] * block_size
    for acc, _ in rounds:
        hist[min(acc, block_size - 1)] += 1
    n = len(rounds)
    return {
        "tau": sum(means) / len(means) if means else float("nan"),
        "tau_pooled": sum(t for _, t in rounds) / n if n else float("nan"),
        "histogram": hist,
        "per_slot": [sum(1 for a, _ in rounds if a >= k) / n if n else float("nan") for k in range(1, block_size)],
        "rounds": n,
        "prompts": len(means),
        "tokens": sum(t for _, t in rounds),
    }

"""tau per group of prompts, as the field reports it per benchmark: per category label (extraction's
--category-field, with tau@T under evaluate.py --temperature) and per context-length bucket of the
rounds (pipeline/decode/acceptance.py).

A group's tau is the report's own (`tau_over_prompts`, as for the whole sample): the mean over its
prompts of each prompt's mean tokens per round, with its 95% interval over those prompts. For a
context bucket a prompt's tau is over its rounds in that bucket.
"""

from __future__ import annotations

from collections import Counter, defaultdict

from pipeline.decode.acceptance import CONTEXT_LABELS, tau_over_prompts
from pipeline.decode.batch_replay import PromptCounts


def by_category(counts: list[PromptCounts], budgets: tuple[int, ...], category: dict) -> dict:
    """{label: group} over the replayed prompts, with how many of the label's prompts were available;
    {} when the store records no labels."""
    if not category:
        return {}
    available = Counter(category.values())
    members = defaultdict(list)
    for c in counts:
        members[category[(c.shard, c.index)]].append(c)
    return {
        label: {
            **_group(members[label], budgets, lambda c, lane: (c.rounds[lane], c.tokens[lane])),
            "available": available[label],
            **_sampled_of(members[label]),
        }
        for label in sorted(members)
    }


def _sampled_of(members: list[PromptCounts]) -> dict:
    """{"tau_at_temperature": ...} when the replay had a temperature, else {} (the report as without it)."""
    return {"tau_at_temperature": sampled(members)} if members[0].sampled_tokens is not None else {}


def by_context(counts: list[PromptCounts], budgets: tuple[int, ...]) -> dict:
    """{bucket label: group} for every bucket some round fell in (chain's rounds decide which)."""
    out = {}
    for b, label in enumerate(CONTEXT_LABELS):
        reached = [c for c in counts if c.context_rounds[0][b]]
        if reached:
            out[label] = _group(
                reached, budgets, lambda c, lane, b=b: (c.context_rounds[lane][b], c.context_tokens[lane][b])
            )
    return out


def sampled(members: list[PromptCounts]) -> dict:
    """tau@T over members (evaluate.py --temperature): the mean over prompts of each prompt's expected
    tokens per chain round under speculative sampling at T, with its interval, as tau's; tau_low, the
    same mean of the rounds' lower bounds; tau_greedy_drafts, the same tau with greedy drafts verified at T
    (vLLM's default draft_sample_method; pipeline/decode/sampled_acceptance.py)."""
    over = tau_over_prompts([(c.rounds[0], c.sampled_tokens) for c in members])
    low = tau_over_prompts([(c.rounds[0], c.sampled_low) for c in members])
    greedy = tau_over_prompts([(c.rounds[0], c.greedy_drafts) for c in members])
    return {
        "tau": over["tau"],
        "tau_ci95": over["tau_ci95"],
        "tau_low": low["tau"],
        "tau_greedy_drafts": greedy["tau"],
        "tau_greedy_drafts_ci95": greedy["tau_ci95"],
    }


def _group(members: list[PromptCounts], budgets: tuple[int, ...], of) -> dict:
    """Chain (lane 0) and each DDTree budget's tau over members; of(c, lane) -> (rounds, tokens)."""
    chain = tau_over_prompts([of(c, 0) for c in members])
    trees = {str(b): tau_over_prompts([of(c, 1 + i) for c in members]) for i, b in enumerate(budgets)}
    return {
        **chain,
        "ddtree": {b: t["tau"] for b, t in trees.items()},
        "ddtree_ci95": {b: t["tau_ci95"] for b, t in trees.items()},
    }

"""tau per group of prompts, as the field reports it per benchmark: per category label (extraction's
--category-field) and per context-length bucket of the rounds (pipeline/decode/acceptance.py).

A group's tau follows the report's convention: the mean over its prompts of each prompt's mean
tokens per round, with a 95% interval. For a category the prompts are a sample of that category's
available prompts (the interval is corrected for it); for a context bucket a prompt's tau is over
its rounds in that bucket, and the interval is not corrected (which prompts reach a bucket is not
known before replay), so it is the wider one.
"""

from __future__ import annotations

from collections import Counter, defaultdict

from pipeline.decode.acceptance import CONTEXT_LABELS, group_tau
from pipeline.decode.batch_replay import PromptCounts


def by_category(counts: list[PromptCounts], budgets: tuple[int, ...], category: dict) -> dict:
    """{label: group} over the replayed prompts, each label's available prompts its population;
    {} when the store records no labels."""
    if not category:
        return {}
    population = Counter(category.values())
    members = defaultdict(list)
    for c in counts:
        members[category[(c.shard, c.index)]].append(c)
    return {label: {**_group(members[label], budgets, lambda c, lane: (c.rounds[lane], c.tokens[lane]),
                             population[label]), "available": population[label]}
            for label in sorted(members)}


def by_context(counts: list[PromptCounts], budgets: tuple[int, ...]) -> dict:
    """{bucket label: group} for every bucket some round fell in (chain's rounds decide which)."""
    out = {}
    for b, label in enumerate(CONTEXT_LABELS):
        reached = [c for c in counts if c.context_rounds[0][b]]
        if reached:
            out[label] = _group(reached, budgets, lambda c, lane, b=b: (c.context_rounds[lane][b],
                                                                         c.context_tokens[lane][b]), None)
    return out


def _group(members: list[PromptCounts], budgets: tuple[int, ...], of, population: int | None) -> dict:
    """Chain (lane 0) and each DDTree budget's tau over members; of(c, lane) -> (rounds, tokens)."""
    chain = group_tau([of(c, 0) for c in members], population)
    trees = {str(b): group_tau([of(c, 1 + i) for c in members], population) for i, b in enumerate(budgets)}
    return {**chain, "ddtree": {b: t["tau"] for b, t in trees.items()},
            "ddtree_ci95": {b: t["tau_ci95"] for b, t in trees.items()}}

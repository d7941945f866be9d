"""The reference replay: one prompt at a time, one forward a round, what evaluate.py's batched replay
(pipeline/decode/batch_replay.py) is tested against, prompt by prompt (tests/pipeline/decode/
test_batch_replay.py, tests/stages/test_evaluate.py), and what `python -m bench.eval_bench replay`
times it against.
A test aid, so it lives with the tests.

Replay greedy speculative decoding from stored states and the stored greedy completion.

The stored completion IS the target's greedy continuation, and the stored states ARE what the
target computes for it, so verifying a draft is a comparison with the stored tokens. Rounds start
at the first completion token (the prefill produced it), each drafts from the states strictly
before its start, accepts per a policy (chain or tree), commits accepted + 1 tokens, and moves on.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from pipeline.decode import ddtree
from pipeline.decode.acceptance import accepted, round_tokens
from pipeline.decode.session import DraftSession
from pipeline.drafter.model import Drafter
from store.shard_reader import Sample

# A policy maps the drafter's logits for slots 1..D [D, V] and the target's tokens for those
# positions [<= D] to the number of accepted drafts.
Policy = Callable[[torch.Tensor, torch.Tensor], int]


def chain(logits: torch.Tensor, target: torch.Tensor) -> int:
    return accepted(logits.argmax(-1).tolist(), target.tolist())


def tree(budget: int) -> Policy:
    def policy(logits: torch.Tensor, target: torch.Tensor) -> int:
        return ddtree.accept(ddtree.build_tree(ddtree.slot_logprobs(logits), budget), target)

    return policy


@dataclass
class PromptRounds:
    shard: int
    index: int
    row_id: int
    prompt_len: int
    completion_len: int
    rounds: list[tuple[int, int]] = field(default_factory=list)  # (accepted drafts, tokens committed)
    drafts: list[list[int]] = field(default_factory=list)  # each round's argmax drafts, with keep_drafts

    @property
    def tau(self) -> float:
        return sum(t for _, t in self.rounds) / len(self.rounds) if self.rounds else float("nan")


def replay(
    drafter: Drafter, sample: Sample, policy: Policy = chain, max_rounds: int | None = None, keep_drafts: bool = False
) -> PromptRounds:
    tokens, T, P = sample.tokens, len(sample.tokens), sample.prompt_len
    D = drafter.config.block_size - 1
    out = PromptRounds(sample.shard, sample.index, sample.row_id, P, T - P)
    session = DraftSession(drafter)
    session.extend(sample.hidden[:P])  # the prompt's states; the block starts at the first completion token
    start = P
    while start < T - 1 and (max_rounds is None or len(out.rounds) < max_rounds):
        logits = session.draft(int(tokens[start]))  # [D, V]
        if keep_drafts:
            out.drafts.append(logits.argmax(-1).tolist())
        acc = policy(logits, tokens[start + 1 : start + 1 + D])
        n = round_tokens(acc, T - 1 - start)
        out.rounds.append((acc, n))
        session.extend(sample.hidden[start : start + n])  # states of the block's committed positions
        start += n
    return out

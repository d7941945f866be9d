"""Live greedy speculative decoding with the target model (what replay stands in for).

Each round drafts a block from the target states strictly before its start (the drafter's cached
context), the target verifies the block in one forward pass, the leading drafts equal to the
target's greedy tokens are accepted, the target's next token is the bonus, and the target's cache
(attention KV, Gated DeltaNet conv and recurrent state) is rolled back to the last accepted token
(pipeline/target/verifier.py). The drafter sees the target's states rounded to bf16, as the store holds
them. Generation stops at an end-of-sequence token or after max_new_tokens, as extraction did.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from pipeline.decode.acceptance import accepted, round_tokens
from pipeline.decode.session import DraftSession
from pipeline.drafter.model import Drafter
from pipeline.target.verifier import LiveTarget


@dataclass
class LiveRun:
    tokens: list[int]  # the completion, first token (from the prefill) included
    rounds: list[tuple[int, int]] = field(default_factory=list)  # (accepted drafts, tokens committed)
    drafts: list[list[int]] = field(default_factory=list)  # each round's drafts (cut to the tokens allowed)
    seconds: float = 0.0


def _stored_like(states: torch.Tensor) -> torch.Tensor:
    return states.to(torch.bfloat16)  # [n, n_taps, H]: what the store would hold


def speculative(
    drafter: Drafter, target: LiveTarget, prompt: torch.Tensor, max_new_tokens: int, eos: set[int]
) -> LiveRun:
    t0 = time.perf_counter()
    B = drafter.config.block_size
    first, states = target.prefill(prompt)
    session = DraftSession(drafter)
    session.extend(_stored_like(states))
    run = LiveRun([first])
    P = len(prompt)
    start = P  # position of the last committed token
    while first not in eos and start < P + max_new_tokens - 1:
        left = P + max_new_tokens - 1 - start  # tokens still allowed after position start
        drafts = session.chain(run.tokens[-1]).tolist()[: min(B - 1, left)]
        run.drafts.append(drafts)
        posterior, block_states = target.verify(torch.tensor([run.tokens[-1], *drafts]))
        acc = accepted(drafts, posterior.tolist())
        new = posterior[: acc + 1].tolist()  # drafts[:acc] == posterior[:acc], then the bonus
        stop = next((i + 1 for i, t in enumerate(new) if t in eos), None)  # tokens up to an EOS, EOS kept
        end = min(left, stop or len(new))
        acc, n = min(acc, end), round_tokens(acc, end)
        target.commit(n)
        session.extend(_stored_like(block_states[:n]))
        run.tokens += new[:n]
        run.rounds.append((acc, n))
        start += n
        if stop is not None and stop <= n:
            break
    run.seconds = time.perf_counter() - t0
    return run


def greedy(target: LiveTarget, prompt: torch.Tensor, max_new_tokens: int, eos: set[int]) -> LiveRun:
    """Target-only greedy decoding with the same cache machinery: the speed baseline."""
    t0 = time.perf_counter()
    token, _ = target.prefill(prompt)
    run = LiveRun([token])
    while token not in eos and len(run.tokens) < max_new_tokens:
        posterior, _ = target.verify(torch.tensor([token]))
        target.commit(1)
        token = int(posterior[0])
        run.tokens.append(token)
    run.seconds = time.perf_counter() - t0
    return run

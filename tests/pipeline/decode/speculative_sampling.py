"""Live speculative sampling at a temperature with the target model: what replayed tau@T
(pipeline/decode/sampled_acceptance.py, evaluate.py --temperature) is checked against. A test aid, so it
lives with the tests.

The algorithm: the drafter drafts its block in one pass and each slot's draft is sampled from its
q = softmax(logits / T); the target runs the block in one forward; draft i is accepted with probability
min(1, p_i(x) / q_i(x)), p_i the target's softmax(logits / T) after the tokens before it; at the first
rejection the target's token is sampled from norm(max(0, p_i - q_i)), and when every draft is accepted
the bonus from the target's next distribution. The target here is the Hugging Face model run on the
whole sequence each time (no cache: the tiny target is small), never the store.
"""

from __future__ import annotations

import torch

from pipeline.decode.sampled_acceptance import distribution
from pipeline.decode.session import DraftSession
from pipeline.drafter.model import Drafter
from pipeline.target.taps import tapping


def _sampled(q: torch.Tensor, n: int, g: torch.Generator) -> torch.Tensor:
    """q: [D, V] -> n draws of every slot's token: [n, D]."""
    return torch.multinomial(q, n, replacement=True, generator=g).T


def _accepted(p: torch.Tensor, q: torch.Tensor, drafts: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """p: [n, D, V] the target's, q: [D, V] or [n, D, V] the drafter's, drafts: [n, D] -> accepted drafts [n]
    (leading acceptances, each with probability min(1, p(x) / q(x)))."""
    at = drafts[..., None]
    ratio = p.gather(-1, at)[..., 0] / q.expand_as(p).gather(-1, at)[..., 0]
    accept = torch.rand(drafts.shape, generator=g, dtype=ratio.dtype) < ratio
    return accept.int().cumprod(1).sum(1)


def _dspark_sampled(base: torch.Tensor, head, before: torch.Tensor | None, first: int, T: float, n: int, g):
    """A dspark drafter's drafts sampled slot after slot: slot i from softmax((base_i + bias(prev)) / T), prev
    the token sampled at slot i - 1 (the block's first token for slot 1) or, with before ([D] long), the
    reference's token there -> (drafts [n, D], q [n, D, V]). base: [D, V] the backbone's logits."""
    prev, drafts, qs = torch.full((n,), first), [], []
    for i in range(base.shape[0]):
        if before is not None:
            prev = before[i].expand(n)
        q = distribution(base[i] + head.bias(head.embed(prev), base.dtype), T)  # [n, V]
        prev = torch.multinomial(q, 1, generator=g)[:, 0]
        drafts.append(prev)
        qs.append(q)
    return torch.stack(drafts, 1), torch.stack(qs, 1)


@torch.no_grad()
def block_tokens(
    model,
    draft_logits: torch.Tensor,
    reference: torch.Tensor,
    start: int,
    temperature: float,
    n: int,
    g: torch.Generator,
    along_reference: bool = False,
    head=None,
) -> torch.Tensor:
    """n runs of one block of speculative sampling from the reference context (teacher-forced: the block's
    first token is reference[start], the context reference[:start]) -> tokens committed by each [n] (accepted
    drafts + 1, cut to the reference's tokens left, as replay counts). draft_logits: [D, V] the drafter's for
    slots 1..D. The target's p for slot i comes from its forward over [reference[:start + 1], drafts[:i - 1]]
    (live: along the sampled drafts) or, along_reference, over reference[:start + i] (what replay assumes).
    head: a dspark drafter's Markov head, draft_logits then its backbone's: slot i's q carries the bias of
    the token before it, the sampled draft (live) or, along_reference, the reference's (as replay takes it)."""
    remaining = len(reference) - 1 - start
    D = min(draft_logits.shape[0], remaining)
    if head is None:
        q = distribution(draft_logits[:D], temperature)  # [D, V]
        drafts = _sampled(q, n, g)  # [n, D]
    else:  # a dspark drafter: each slot's q after the token before it (sampled, or the reference's)
        before = reference[start : start + D] if along_reference else None
        drafts, q = _dspark_sampled(draft_logits[:D], head, before, int(reference[start]), temperature, n, g)
    if along_reference:
        logits = model(reference[None, : start + D]).logits[:, start:].expand(n, -1, -1)
    else:
        ids = torch.cat([reference[: start + 1].expand(n, -1), drafts[:, :-1]], dim=1)  # the last draft: no p after it
        logits = model(ids).logits[:, start:]  # [n, D, V]: position start + i - 1 predicts slot i
    acc = _accepted(distribution(logits, temperature), q, drafts, g)
    return torch.clamp(acc + 1, max=remaining)


@torch.no_grad()
def free_running(
    target, drafter: Drafter, taps: list[int], prompt: torch.Tensor, max_new_tokens: int, T: float, g
) -> list[int]:
    """One fully live sampled run from the prompt (the first token sampled from the prefill, then rounds
    until an end-of-sequence token or max_new_tokens, as extraction stops) -> tokens committed per round."""
    eos, B = set(target.eos_ids), drafter.config.block_size
    seq = prompt.tolist()
    logits, states = _forward(target, taps, seq)
    seq.append(int(torch.multinomial(distribution(logits[-1], T), 1, generator=g)))
    session = DraftSession(drafter)
    session.extend(states[: len(prompt)])
    rounds, made = [], 1
    while seq[-1] not in eos and made < max_new_tokens:
        start, D = len(seq) - 1, min(B - 1, max_new_tokens - made)
        base = session.draft(seq[-1])[:D]  # [D, V]
        if drafter.config.head == "dspark":  # slot after slot, each after the token sampled before it
            sampled, q = _dspark_sampled(base, drafter.markov_head, None, seq[-1], T, 1, g)
            drafts, q = sampled[0].tolist(), q[0]
        else:
            q = distribution(base, T)  # [D, V]
            drafts = _sampled(q, 1, g)[0].tolist()
        logits, states = _forward(target, taps, seq + drafts)
        p = distribution(logits[start : start + D + 1], T)  # [D + 1, V]: slots 1..D and the bonus
        acc = int(_accepted(p[None, :D], q, torch.tensor([drafts]), g))
        last = p[D] if acc == D else torch.clamp(p[acc] - q[acc], min=0)
        new = [*drafts[:acc], int(torch.multinomial(last / last.sum(), 1, generator=g))]
        stop = next((i + 1 for i, t in enumerate(new) if t in eos), len(new))
        new = new[: min(stop, max_new_tokens - made)]
        session.extend(states[start : start + len(new)])  # the committed positions' states
        seq += new
        made += len(new)
        rounds.append(len(new))
    return rounds


def _forward(target, taps: list[int], ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The target over ids -> (logits [L, V] fp32, tap states [L, n_taps, H] rounded to bf16 as stored)."""
    got = {}
    with tapping(target.layers, taps, got.__setitem__):
        logits = target.model(torch.tensor([ids])).logits[0].float()
    return logits, torch.stack([got[k][0] for k in taps], dim=1).to(torch.bfloat16)

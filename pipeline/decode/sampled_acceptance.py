"""Acceptance under speculative sampling at a temperature: each slot's acceptance probability from the
target's and the drafter's distributions, and the tokens a round commits in expectation.

Speculative sampling drafts x ~ q and accepts it with probability min(1, p(x) / q(x)); over the draft,
the slot is accepted with probability alpha = sum_x q(x) min(1, p(x) / q(x)) = sum_x min(p(x), q(x)).
On a rejection the target resamples from norm(max(0, p - q)); after the last slot it adds a token of
its own from p: either way one token more than the drafts accepted, the bonus greedy tau counts too.

Replay knows p only along the stored reference (softmax(lm_head(final state) / T) at each position),
so slot i's alpha is taken with the target conditioned on the reference tokens before it, not on the
drafts sampled and accepted there, and the slots' acceptances are then independent given the block:
P(accepted >= i) = alpha_1 ... alpha_i. Exact where the accepted drafts are the reference's tokens (as
greedy replay's are); an approximation where a sampled draft differs from them.

A bound needs no such assumption: the drafts of slots 1..k-1 are accepted AND equal to the reference
tokens with probability m_1 ... m_(k-1), m_j = min(p_j(r_j), q_j(r_j)) (the target's p_j is then the
stored one), and slot k is then accepted with alpha_k, so P(accepted >= k) >= m_1 ... m_(k-1) alpha_k:
`expected_tokens_low`, a lower bound on live sampling from the same context (DFlash's q does not depend
on the drafts sampled before a slot: the block is drafted in one pass).

Greedy drafts (vLLM's default draft_sample_method "greedy"): the drafter's argmax d is verified as if its
draft probability were 1, so it is accepted with probability min(1, p_T(d)) = p_T(d): `draft_acceptance`,
chained as alpha is, along the reference alike. At T -> 0 on a greedy store both figures are greedy tau.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def distribution(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """softmax(logits / T) over the last dimension, in fp32."""
    return torch.softmax(logits.float() / temperature, dim=-1)


def slot_acceptance(target_logits: torch.Tensor, draft_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """target_logits, draft_logits: [..., V] of the same slots -> alpha [...] fp32: the probability that a
    draft sampled from q_T is accepted against p_T, sum_x min(p_T(x), q_T(x)) (1 - their total variation)."""
    p, q = distribution(target_logits, temperature), distribution(draft_logits, temperature)
    return torch.minimum(p, q).sum(-1).clamp(0.0, 1.0)


def reference_acceptance(
    target_logits: torch.Tensor, draft_logits: torch.Tensor, reference: torch.Tensor, temperature: float
) -> torch.Tensor:
    """As slot_acceptance, reference: [...] the reference's token of each slot -> m [...]: the probability
    that the slot's sampled draft is accepted and is that token, min(p_T(r), q_T(r))."""
    p, q = distribution(target_logits, temperature), distribution(draft_logits, temperature)
    at = reference[..., None]
    return torch.minimum(p.gather(-1, at), q.gather(-1, at))[..., 0]


def draft_acceptance(target_logits: torch.Tensor, drafts: torch.Tensor, temperature: float) -> torch.Tensor:
    """target_logits: [..., V]; drafts: [...] the drafter's greedy tokens of those slots -> [...] fp32: the
    probability that each greedy draft is accepted against p_T, p_T(draft) (module doc)."""
    return distribution(target_logits, temperature).gather(-1, drafts[..., None])[..., 0]


def expected_tokens_low(alpha: Sequence[float], on_reference: Sequence[float], remaining: int) -> float:
    """A lower bound on `expected_tokens` without the along-the-reference assumption: P(accepted >= k) >=
    on_reference[0] ... on_reference[k-2] * alpha[k-1] (the module's docstring)."""
    expected, stay = 1.0, 1.0
    for k in range(1, min(len(alpha) + 1, remaining)):
        expected += stay * float(alpha[k - 1])
        stay *= float(on_reference[k - 1])
    return expected


def expected_tokens(alpha: Sequence[float], remaining: int) -> float:
    """The tokens a round commits in expectation, as greedy replay counts them (`acceptance.round_tokens`:
    accepted drafts + 1, cut to the `remaining` tokens left): alpha[i-1], slot i's acceptance given the
    slots before it accepted. tokens >= k iff accepted >= k - 1, so E = sum over k = 0 .. min(D + 1,
    remaining) - 1 of P(accepted >= k), with P(accepted >= k) = alpha[0] ... alpha[k-1] (1 at k = 0)."""
    expected, reach = 0.0, 1.0
    for k in range(min(len(alpha) + 1, remaining)):
        expected += reach
        if k < len(alpha):
            reach *= float(alpha[k])
    return expected

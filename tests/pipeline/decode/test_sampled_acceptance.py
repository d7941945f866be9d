"""Acceptance at a temperature: each slot's probability against the speculative sampling rule counted
out draft by draft, and the expected tokens of a round against every acceptance pattern enumerated."""

import itertools

import pytest
import torch

from pipeline.decode.acceptance import round_tokens
from pipeline.decode.sampled_acceptance import distribution, draft_acceptance, expected_tokens, slot_acceptance


def test_slot_acceptance_is_the_probability_that_a_sampled_draft_is_accepted():
    g = torch.Generator().manual_seed(0)
    p_logits, q_logits = torch.randn(3, 7, generator=g) * 2, torch.randn(3, 7, generator=g) * 2
    for T in (0.5, 1.0, 2.0):
        p, q = distribution(p_logits, T), distribution(q_logits, T)
        # the rule as the algorithm applies it: draft x with probability q(x), accept it with min(1, p(x)/q(x))
        by_rule = (q * torch.clamp(p / q, max=1.0)).sum(-1)
        assert torch.allclose(slot_acceptance(p_logits, q_logits, T), by_rule, atol=1e-6)
        assert torch.allclose(slot_acceptance(p_logits, q_logits, T), 1 - 0.5 * (p - q).abs().sum(-1), atol=1e-6)
    assert torch.allclose(slot_acceptance(p_logits, p_logits, 0.7), torch.ones(3))  # q = p: always accepted


def test_a_low_temperature_accepts_exactly_where_the_argmaxes_agree():
    p = torch.tensor([[3.0, 1.0, 0.0], [0.0, 2.0, 1.0]])
    q = torch.tensor([[2.0, 0.0, 1.0], [2.0, 0.0, 1.0]])  # agrees with p's argmax on the first slot only
    assert slot_acceptance(p, q, 1e-3).tolist() == pytest.approx([1.0, 0.0], abs=1e-6)


def test_a_greedy_draft_is_accepted_with_the_targets_probability_of_it():
    """vLLM's draft_sample_method greedy: the rule's ratio min(1, p(x) / 1) for the drafter's argmax x,
    counted out by drawing the uniform; at a low temperature: 1 where the argmaxes agree, else 0."""
    p = torch.tensor([[3.0, 1.0, 0.0], [0.0, 2.0, 1.0]])
    drafts = torch.tensor([0, 0])
    u = torch.rand(200_000, 1, generator=torch.Generator().manual_seed(0))
    counted = (u < distribution(p, 1.0).gather(1, drafts[:, None]).T).float().mean(0)
    assert draft_acceptance(p, drafts, 1.0).tolist() == pytest.approx(counted.tolist(), abs=0.005)
    assert draft_acceptance(p, drafts, 1e-3).tolist() == pytest.approx([1.0, 0.0], abs=1e-6)


@pytest.mark.parametrize("remaining", [1, 2, 3, 4, 5, 9])
def test_expected_tokens_enumerates_every_acceptance_pattern(remaining):
    """E[min(accepted + 1, remaining)] with slot i accepted with probability alpha_i given the slots
    before it: every pattern of 0/1 outcomes weighed, the accepted count its leading ones."""
    alpha = [0.9, 0.6, 0.3, 0.8]
    expected = 0.0
    for outcome in itertools.product((0, 1), repeat=len(alpha)):
        weight = 1.0
        for a, o in zip(alpha, outcome):
            weight *= a if o else 1 - a
        acc = next((i for i, o in enumerate(outcome) if not o), len(alpha))
        expected += weight * round_tokens(min(acc, remaining), remaining)  # as replay cuts the drafts
    assert expected_tokens(alpha, remaining) == pytest.approx(expected)


def test_certain_acceptance_counts_as_greedy_replay_does():
    for remaining in (1, 3, 5, 20):
        assert expected_tokens([1.0] * 4, remaining) == round_tokens(min(4, remaining), remaining)
        assert expected_tokens([0.0] * 4, remaining) == round_tokens(0, remaining) == 1


def _exact_live(p_along, q, reference, remaining):
    """E[tokens] of speculative sampling from the reference context, every draft sequence enumerated:
    p_along(prefix) -> the target's distribution after the drafts `prefix` (any function of them)."""
    D, V = q.shape
    total = 0.0
    for drafts in itertools.product(range(V), repeat=D):
        weight = float(torch.prod(q[torch.arange(D), torch.tensor(drafts)]))
        reach, tokens = 1.0, 0.0
        for k in range(min(D + 1, remaining)):
            tokens += reach  # P(accepted >= k | drafts)
            if k < D:
                p = p_along(drafts[:k])
                reach *= min(1.0, float(p[drafts[k]] / q[k, drafts[k]]))
        total += weight * tokens
    return total


def test_the_lower_bound_holds_whatever_the_target_does_off_the_reference():
    """A target whose distribution after an off-reference draft is anything at all: live sampling's exact
    expectation lies between expected_tokens_low and 1 + D; where the target ignores the drafts (p the same
    along any prefix), it equals expected_tokens, the along-the-reference value."""
    from pipeline.decode.sampled_acceptance import expected_tokens_low, reference_acceptance

    g = torch.Generator().manual_seed(1)
    D, V, T = 3, 3, 1.0
    p_logits, q_logits = torch.randn(D, V, generator=g) * 2, torch.randn(D, V, generator=g) * 2
    reference = torch.tensor([0, 2, 1])
    p_ref, q = distribution(p_logits, T), distribution(q_logits, T)
    alpha = slot_acceptance(p_logits, q_logits, T).tolist()
    m = reference_acceptance(p_logits, q_logits, reference, T).tolist()
    for remaining in (2, 3, 9):
        same = _exact_live(lambda prefix: p_ref[len(prefix)], q, reference, remaining)
        assert same == pytest.approx(expected_tokens(alpha, remaining), abs=1e-5)
        below = []
        for seed in range(5):
            other = torch.softmax(torch.randn(D, V, generator=torch.Generator().manual_seed(seed)) * 3, -1)

            def along(prefix, other=other):
                return p_ref[len(prefix)] if list(prefix) == reference[: len(prefix)].tolist() else other[len(prefix)]

            live = _exact_live(along, q, reference, remaining)
            assert expected_tokens_low(alpha, m, remaining) <= live + 1e-6
            below.append(live < expected_tokens(alpha, remaining) - 1e-3)
        # the along-the-reference value is no bound: live sampling can fall short of it (past slot 1, whose
        # target distribution no draft changes)
        assert any(below) == (remaining > 2)
        assert expected_tokens_low(alpha, m, remaining) <= expected_tokens(alpha, remaining)
    assert expected_tokens_low(alpha, alpha, 9) == pytest.approx(expected_tokens(alpha, 9))

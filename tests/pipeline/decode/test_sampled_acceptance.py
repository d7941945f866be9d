"""Acceptance at a temperature: each slot's probability against the speculative sampling rule counted
out draft by draft, and the expected tokens of a round against every acceptance pattern enumerated."""

import itertools

import pytest
import torch

from pipeline.decode.acceptance import round_tokens
from pipeline.decode.sampled_acceptance import distribution, expected_tokens, slot_acceptance


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

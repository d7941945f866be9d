"""Soft targets: each slot's KL and TV toward the target's distribution from the final state before it, against a
direct computation from full logits (values and gradients, any chunk size); the mixes dflash_loss makes of them;
p equal to q costs nothing."""

import pytest
import torch

from pipeline.drafter.blocks import IGNORE
from pipeline.drafter.loss import dflash_loss, dpace_weights, expected_accepted
from pipeline.drafter.soft_targets import rejection_log, slot_terms

H, V, B = 8, 13, 5


def case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(2, 3 * B, H, generator=g, requires_grad=True)  # [b, N*B, H]
    labels = torch.randint(0, V, (2, 3, B), generator=g)
    labels[..., 0] = IGNORE
    labels[1, 2, 3:] = IGNORE
    target = torch.randn(2, 3, B, H, generator=g)  # the final state before each slot
    return h, labels, torch.randn(V, H, generator=g), target


def direct(h, labels, lm_head, target):
    """Per kept slot (ce, kl, tv) from full logits."""
    keep = labels != IGNORE
    q = torch.softmax(h.reshape(*labels.shape, -1)[keep] @ lm_head.T, -1)
    p = torch.softmax(target[keep] @ lm_head.T, -1)
    ce = -q.gather(1, labels[keep][:, None]).squeeze(1).log()
    return ce, (p * (p.log() - q.log())).sum(-1), 0.5 * (p - q).abs().sum(-1)


@pytest.mark.parametrize("rows", [4, 12, 4096])  # chunks of 1 and 3 rows, and one chunk
def test_kl_and_tv_are_the_direct_ones_with_their_gradients(rows):
    h, labels, lm_head, target = case()
    keep = labels != IGNORE
    terms = slot_terms(h.reshape(*labels.shape, H)[keep], lm_head, labels[keep], rows, target[keep])
    want = direct(h, labels, lm_head, target)
    for got, ref in zip((terms.ce, terms.kl, terms.tv), want):
        torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6)
    for k, ref in zip(("kl", "tv"), want[1:]):
        (g,) = torch.autograd.grad(getattr(terms, k).sum(), h, retain_graph=True)
        (g_ref,) = torch.autograd.grad(ref.sum(), h, retain_graph=True)
        torch.testing.assert_close(g, g_ref, rtol=1e-4, atol=1e-6)
    assert (terms.pred == (h.reshape(*labels.shape, H)[keep] @ lm_head.T).argmax(-1)).all()


def test_a_target_equal_to_the_drafter_costs_nothing():
    h, labels, lm_head, _ = case(1)
    keep = labels != IGNORE
    hs = h.reshape(*labels.shape, H)[keep]
    terms = slot_terms(hs, lm_head, labels[keep], 4096, hs.detach().clone())
    assert terms.kl.abs().max() < 1e-5 and terms.tv.abs().max() < 1e-6
    (g,) = torch.autograd.grad(terms.kl.sum(), h)
    assert g.abs().max() < 1e-5


def test_tv_toward_a_one_hot_target_is_one_minus_the_drafters_probability_of_its_token():
    g = torch.Generator().manual_seed(2)
    wide = 2 * V  # states wider than the vocabulary: any logits are some state's
    lm_head, hs = torch.randn(V, wide, generator=g), torch.randn(20, wide, generator=g)
    y = torch.randint(0, V, (20,), generator=g)
    sharp = torch.linalg.pinv(lm_head) @ (torch.nn.functional.one_hot(y, V).float() * 60).T  # logits 60 at y, else 0
    terms = slot_terms(hs, lm_head, y, 4096, sharp.T)
    torch.testing.assert_close(terms.tv, 1 - torch.exp(-terms.ce), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("soft", ["kl", "tv"])
def test_the_mix_is_the_soft_weight_of_the_weighted_term_and_the_rest_of_the_weighted_ce(soft):
    h, labels, lm_head, target = case(3)
    keep = labels != IGNORE
    ce, kl, tv = direct(h, labels, lm_head, target)
    full = torch.zeros(keep.shape)
    full[keep] = ce.detach()
    w = dpace_weights(full, keep, 0.5)[keep]
    term = {"kl": kl, "tv": tv}[soft]
    want = 0.3 * (w * term).sum() / w.sum() + 0.7 * (w * ce).sum() / w.sum()
    got = dflash_loss(h, labels, lm_head, None, dpace=0.5, soft=soft, soft_weight=0.3, target=target)
    torch.testing.assert_close(got.loss, want, rtol=1e-5, atol=1e-6)
    plain = dflash_loss(h, labels, lm_head, None, dpace=0.5)
    # the metrics stay the hard-label ones: their CE by another path (slot_terms), equal to fp32 rounding
    torch.testing.assert_close(got.sums, plain.sums, rtol=1e-6, atol=0)


def test_accept_is_the_expected_acceptance_with_each_slots_chance_one_minus_tv():
    h, labels, lm_head, target = case(4)
    keep = labels != IGNORE
    _, _, tv = direct(h, labels, lm_head, target)
    alpha = torch.ones(keep.shape)
    alpha[keep] = 1 - tv
    reach = keep[..., 1:].float().cumprod(-1)
    e = (alpha[..., 1:].cumprod(-1) * reach).sum(-1)  # [b, N]: sum over j of alpha_1 ... alpha_j
    counted = keep[..., 1]
    want = (1 - e[counted] / (B - 1)).mean()
    got = dflash_loss(h, labels, lm_head, 2.0, soft="accept", soft_weight=1.0, target=target)
    torch.testing.assert_close(got.loss, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(expected_accepted(rejection_log(tv), keep)[counted], e[counted])

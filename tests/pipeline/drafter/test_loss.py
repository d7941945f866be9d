"""The DFlash loss and its metrics on hand-made cases."""

import math

import pytest
import torch

from pipeline.drafter.blocks import IGNORE
from pipeline.drafter.loss import dflash_loss, slot_weights, streaks, summarize

V = 5
HEAD = torch.eye(V)  # lm_head = identity: the drafter output IS the logits


def logits_for(label: int, confident: bool) -> list[float]:
    return [10.0 if (i == label and confident) else 0.0 for i in range(V)]


def test_slot_weights():
    w = slot_weights(16, 7.0)
    assert w[0] == 0 and w[1] == 1 and math.isclose(float(w[2]), math.exp(-1 / 7), rel_tol=1e-6)
    assert math.isclose(float(w[15]), math.exp(-14 / 7), rel_tol=1e-6)


def test_weighted_ce_by_hand():
    # one block of 3 slots: slot 1 uniform over V (CE = ln V), slot 2 confident and right (CE ~ 0)
    h = torch.tensor([[logits_for(0, True), [0.0] * V, logits_for(3, True)]])
    labels = torch.tensor([[[IGNORE, 1, 3]]])
    out = dflash_loss(h, labels, HEAD, gamma=2.0)
    w1, w2 = 1.0, math.exp(-1 / 2)
    ce2 = math.log(1 + (V - 1) * math.exp(-10))
    assert math.isclose(float(out.loss), (w1 * math.log(V) + w2 * ce2) / (w1 + w2), rel_tol=1e-5)


def test_slot0_never_counts():
    h = torch.tensor([[[0.0, 0, 0, 0, 50], logits_for(2, True)]])
    with_label = dflash_loss(h, torch.tensor([[[0, 2]]]), HEAD, gamma=7.0).loss  # a (wrong) label at slot 0
    without = dflash_loss(h, torch.tensor([[[IGNORE, 2]]]), HEAD, gamma=7.0).loss
    assert torch.equal(with_label, without)


def test_ignored_labels_change_nothing():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(1, 8, V, generator=g)
    a = torch.tensor([[[IGNORE, 1, 2, 3], [IGNORE, 4, IGNORE, IGNORE]]])
    b = torch.tensor([[[IGNORE, 1, 2, 3], [IGNORE, 4, IGNORE, IGNORE]]])
    h2 = h.clone()
    h2[0, 6:] = 99.0  # outputs at ignored slots are irrelevant
    assert torch.equal(dflash_loss(h, a, HEAD, 7.0).loss, dflash_loss(h2, b, HEAD, 7.0).loss)


def test_chunked_equals_whole_including_gradients():
    g = torch.Generator().manual_seed(1)
    labels = torch.randint(0, V, (2, 3, 4), generator=g)
    labels[..., 0] = IGNORE
    labels[1, 2, 2:] = IGNORE
    grads = []
    for chunk in (1, 5, 4096):
        h = torch.randn(2, 12, V, generator=torch.Generator().manual_seed(2), requires_grad=True)
        out = dflash_loss(h, labels, HEAD, 7.0, chunk=chunk)
        out.loss.backward()
        grads.append((out.loss.detach(), h.grad))
    for loss, grad in grads[1:]:
        assert torch.allclose(loss, grads[0][0]) and torch.allclose(grad, grads[0][1])


def test_streaks_and_tau():
    correct = torch.tensor([[[False, True, True, False, True], [True, False, True, True, True]]])
    keep = torch.ones_like(correct)
    keep[0, 1, 0] = False
    assert streaks(correct, keep).tolist() == [[2, 0]]
    keep2 = keep.clone()
    keep2[0, 0, 2:] = False  # labels end after slot 1: the streak stops there
    assert streaks(correct, keep2).tolist() == [[1, 0]]


def test_summary_of_a_perfect_and_a_hopeless_block():
    h = torch.tensor([[logits_for(0, True), logits_for(1, True), logits_for(2, True),
                       logits_for(0, True), logits_for(4, True), logits_for(4, True)]])
    labels = torch.tensor([[[IGNORE, 1, 2], [IGNORE, 3, 4]]])
    m = summarize(dflash_loss(h, labels, HEAD, 7.0).sums)
    assert m["tau_streak"] == pytest.approx((3 + 1) / 2)  # block 0: 2 drafts + bonus; block 1: bonus only
    assert m["acc"] == [0.5, 1.0] and m["blocks"] == 2 and m["labels"] == 4

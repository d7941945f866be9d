"""Anchors, block inputs and labels on hand-made sequences."""

import torch

from pipeline.drafter.blocks import IGNORE, anchor_candidates, make_blocks, sample_anchors

MASK = 99


def test_anchor_candidates_need_two_completion_tokens():
    lm = torch.tensor([0, 0, 1, 1, 1, 0], dtype=torch.bool)
    assert anchor_candidates(lm).tolist() == [2, 3]


def test_sample_anchors_sorted_unique_capped_and_deterministic():
    lm = torch.zeros(2, 40, dtype=torch.bool)
    lm[0, 5:40] = True
    lm[1, 10:13] = True
    a, v = sample_anchors(lm, 8, torch.Generator().manual_seed(0))
    b, _ = sample_anchors(lm, 8, torch.Generator().manual_seed(0))
    c, _ = sample_anchors(lm, 8, torch.Generator().manual_seed(1))
    assert torch.equal(a, b) and not torch.equal(a, c)
    assert v[0].all() and v[1].tolist() == [True, True] + [False] * 6
    row = a[0].tolist()
    assert row == sorted(set(row)) and len(row) == 8 and all(5 <= x < 39 for x in row)
    assert a[1, :2].tolist() == [10, 11]


def test_blocks_labels_slot0_end_and_mask():
    tokens = torch.arange(10, 20)[None]  # token[i] = 10 + i
    lm = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 1, 1, 1]], dtype=torch.bool)
    anchors, valid = torch.tensor([[3, 8, 0]]), torch.tensor([[True, True, False]])
    blk = make_blocks(tokens, lm, anchors, valid, 4, MASK)
    assert blk.block_ids.tolist() == [[13, MASK, MASK, MASK, 18, MASK, MASK, MASK, 10, MASK, MASK, MASK]]
    assert blk.positions.tolist() == [[3, 4, 5, 6, 8, 9, 10, 11, 0, 1, 2, 3]]
    assert blk.labels[0, 0].tolist() == [IGNORE, 14, 15, 16]  # slot k predicts token[a + k]
    assert blk.labels[0, 1].tolist() == [IGNORE, 19, IGNORE, IGNORE]  # past the end: dropped
    assert (blk.labels[0, 2] == IGNORE).all()  # padded anchor: no labels


def test_labels_outside_loss_mask_dropped():
    tokens = torch.arange(8)[None]
    lm = torch.tensor([[0, 1, 1, 1, 0, 0, 0, 0]], dtype=torch.bool)  # e.g. padding after the completion
    blk = make_blocks(tokens, lm, torch.tensor([[1]]), torch.tensor([[True]]), 5, MASK)
    assert blk.labels[0, 0].tolist() == [IGNORE, 2, 3, IGNORE, IGNORE]

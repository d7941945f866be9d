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


def budget_rows():
    lm = torch.zeros(4, 300, dtype=torch.bool)
    lm[0, 10:290] = True  # 279 candidates
    lm[1, 50:90] = True  # 39
    lm[2, 0:8] = True  # 7
    lm[3, 100:101] = True  # a single loss token: no candidate
    return lm


def test_anchor_budget_respected_rows_capped_and_valid():
    lm = budget_rows()
    cand = [set(anchor_candidates(row).tolist()) for row in lm]
    for budget in (1, 5, 40, 70):
        a, v = sample_anchors(lm, 32, torch.Generator().manual_seed(budget), budget=budget)
        assert v.sum() == budget and (v.sum(1) <= 32).all() and not v[3].any()
        for i in range(4):
            row = a[i][v[i]].tolist()
            assert row == sorted(set(row)) and set(row) <= cand[i]  # unique, sorted, all candidates
        assert (a[~v] == 0).all()


def test_anchor_budget_shares_by_candidates():
    """Each candidate of the batch is equally likely: over many draws a row's share follows its
    candidates (279 : 39 : 7 of 325) while the budget binds and no row is capped."""
    lm = budget_rows()
    got = torch.zeros(4)
    for seed in range(300):
        _, v = sample_anchors(lm, 100, torch.Generator().manual_seed(seed), budget=50)
        got += v.sum(1)
    share = got / got.sum()
    assert torch.allclose(share[:3], torch.tensor([279, 39, 7]) / 325, atol=0.01) and share[3] == 0


def test_anchor_budget_caps_full_rows_and_fills_from_the_others():
    lm = budget_rows()
    for seed in range(5):  # row 0 holds 86% of the candidates: it fills up, the others take the rest
        _, v = sample_anchors(lm, 8, torch.Generator().manual_seed(seed), budget=20)
        assert v.sum() == 20 and v.sum(1)[0] == 8 and v.sum(1)[1] + v.sum(1)[2] == 12 and v.sum(1)[2] <= 7
    _, v = sample_anchors(lm, 8, torch.Generator().manual_seed(0), budget=22)  # 8 + 8 + 7 = 23 > 22
    assert v.sum() == 22 and v.sum(1).tolist()[3] == 0


def test_anchor_budget_default_unchanged_and_reproducible():
    lm = budget_rows()
    base = sample_anchors(lm, 16, torch.Generator().manual_seed(3))
    for budget in (None, 39, 1000):  # off, or never binding (16 + 16 + 7 = 39): today's draw exactly
        same = sample_anchors(lm, 16, torch.Generator().manual_seed(3), budget=budget)
        assert all(torch.equal(x, y) for x, y in zip(base, same))
    a = sample_anchors(lm, 16, torch.Generator().manual_seed(3), budget=20)
    b = sample_anchors(lm, 16, torch.Generator().manual_seed(3), budget=20)
    c = sample_anchors(lm, 16, torch.Generator().manual_seed(4), budget=20)
    assert all(torch.equal(x, y) for x, y in zip(a, b)) and not torch.equal(a[0], c[0])


def packed_row():
    """One row of three documents (starting at 0, 12 and 30), each a prompt then a completion."""
    lm = torch.zeros(1, 50, dtype=torch.bool)
    lm[0, 4:12] = True  # document 0: completion 4..11, up to its end
    lm[0, 15:30] = True  # document 1: completion 15..29
    lm[0, 33:50] = True  # document 2: completion 33..49
    starts = torch.zeros(1, 50, dtype=torch.long)
    starts[0, 12:30], starts[0, 30:] = 12, 30
    return lm, starts


def test_packed_anchors_are_counted_per_document_and_never_pair_across_one():
    lm, starts = packed_row()
    cand = anchor_candidates(lm[0], starts[0]).tolist()
    assert 11 not in cand and 29 not in cand  # the next token belongs to the next document
    assert cand == list(range(4, 11)) + list(range(15, 29)) + list(range(33, 49))
    for seed in range(20):
        a, v = sample_anchors(lm, 5, torch.Generator().manual_seed(seed), starts=starts)
        row = a[0][v[0]].tolist()
        assert row == sorted(set(row)) and set(row) <= set(cand)
        per_doc = [sum(lo <= x < hi for x in row) for lo, hi in ((0, 12), (12, 30), (30, 50))]
        assert per_doc == [5, 5, 5]  # each document its own --anchors
    a, v = sample_anchors(lm, 5, torch.Generator().manual_seed(0), starts=starts, budget=7)
    assert int(v.sum()) == 7  # a budget pools the documents' candidates


def test_one_document_rows_draw_as_before():
    lm = budget_rows()
    for budget in (None, 20):
        base = sample_anchors(lm, 16, torch.Generator().manual_seed(3), budget=budget)
        same = sample_anchors(
            lm, 16, torch.Generator().manual_seed(3), budget=budget, starts=torch.zeros(lm.shape, dtype=torch.long)
        )
        assert all(torch.equal(x, y) for x, y in zip(base, same))


def test_single_rule_anchors_every_loss_token():
    lm = torch.tensor([0, 0, 1, 1, 1, 0, 1, 0], dtype=torch.bool)
    assert anchor_candidates(lm, rule="single").tolist() == [2, 3, 4, 6]
    assert anchor_candidates(lm).tolist() == [2, 3]


def test_packed_blocks_keep_labels_and_positions_inside_their_document():
    lm, starts = packed_row()
    tokens = torch.arange(100, 150)[None]
    anchors, valid = torch.tensor([[9, 27, 33]]), torch.tensor([[True, True, True]])
    blk = make_blocks(tokens, lm, anchors, valid, 5, MASK, starts)
    assert blk.labels[0, 0].tolist() == [IGNORE, 110, 111, IGNORE, IGNORE]  # 12.. is document 1
    assert blk.labels[0, 1].tolist() == [IGNORE, 128, 129, IGNORE, IGNORE]  # 30.. is document 2
    assert blk.labels[0, 2].tolist() == [IGNORE, 134, 135, 136, 137]
    assert blk.positions.view(3, 5)[:, 0].tolist() == [9, 15, 3]  # positions restart at each document
    assert blk.starts.tolist() == [[0, 12, 30]]
    alone = make_blocks(tokens[:, 30:], lm[:, 30:], anchors[:, 2:] - 30, valid[:, 2:], 5, MASK)
    assert torch.equal(alone.labels[0, 0], blk.labels[0, 2]) and torch.equal(alone.positions[0], blk.positions[0, 10:])

"""The one mask predicate against a brute-force construction of SPEC's rule."""

import itertools

import pytest
import torch

from pipeline.drafter.masks import LayerRule, allowed, bool_mask


def brute(anchors, valid, S, B, rule):
    """SPEC §2 written out: key layout [context 0..S-1 | block 0 | block 1 | ...]."""
    batch, n = anchors.shape
    out = torch.zeros(batch, n * B, S + n * B, dtype=torch.bool)
    for b, q, kv in itertools.product(range(batch), range(n * B), range(S + n * B)):
        blk, j = divmod(q, B)
        a = int(anchors[b, blk])
        q_pos = a + j
        if kv < S:
            ok, k_pos = bool(valid[b, blk]) and kv < a, kv
        else:
            kb, jk = divmod(kv - S, B)
            ok, k_pos = kb == blk, a + jk
            if rule.causal:
                ok = ok and jk <= j
        if rule.window is not None:
            ok = ok and q_pos - k_pos < rule.window
            if not rule.causal:
                ok = ok and k_pos - q_pos < rule.window
        out[b, q, kv] = ok
    return out


RULES = [LayerRule(), LayerRule(causal=True), LayerRule(causal=True, window=5), LayerRule(causal=False, window=4),
         LayerRule(causal=True, window=1)]


@pytest.mark.parametrize("rule", RULES, ids=str)
@pytest.mark.parametrize("seed", range(3))
def test_bool_mask_equals_brute_force(rule, seed):
    g = torch.Generator().manual_seed(seed)
    S, B, n = 13, 4, 3
    anchors = torch.randint(0, S, (2, n), generator=g).sort(-1).values
    anchors[1, 0] = anchors[1, 1]  # overlapping blocks
    valid = torch.tensor([[True, True, True], [True, True, False]])  # a padded anchor
    got = bool_mask(anchors, valid, S, B, rule)[:, 0]
    assert torch.equal(got, brute(anchors, valid, S, B, rule))


def test_context_bound_is_strict_and_blocks_are_isolated():
    anchors, valid = torch.tensor([[5, 7]]), torch.tensor([[True, True]])
    m = bool_mask(anchors, valid, 10, 3, LayerRule())[0, 0]
    assert m[0, :5].all() and not m[0, 5:10].any()  # sees 0..4, not its own anchor's state at 5
    assert m[0, 10:13].all() and not m[0, 13:].any()  # full layer: whole own block, no other block
    assert m[3, :7].all() and not m[3, 7:10].any() and m[3, 13:].all() and not m[3, 10:13].any()


def test_padded_anchor_sees_only_its_block():
    m = bool_mask(torch.tensor([[4, 0]]), torch.tensor([[True, False]]), 6, 2, LayerRule())[0, 0]
    assert not m[2:, :6].any() and m[2:, 8:].all()
    assert m.any(-1).all()  # no empty row, so no NaN in softmax


def test_predicate_is_the_flex_mask_mod():
    """flex calls the predicate one (b, q, kv) at a time; scalar calls agree with the rendered mask."""
    anchors, valid = torch.tensor([[3, 6]]), torch.tensor([[True, True]])
    rule = LayerRule(causal=True, window=3)
    full = bool_mask(anchors, valid, 8, 4, rule)[0, 0]
    for q, kv in itertools.product(range(8), range(16)):
        one = allowed(torch.tensor(0), torch.tensor(q), torch.tensor(kv), anchors=anchors, valid=valid, ctx_len=8,
                      block_size=4, rule=rule)
        assert bool(one) == bool(full[q, kv]), (q, kv)


@pytest.mark.parametrize("rule", RULES, ids=str)
def test_local_mask_is_the_dense_mask_at_block_local_keys(rule):
    from pipeline.drafter.masks import local_mask

    g = torch.Generator().manual_seed(7)
    S, B, n = 11, 3, 4
    anchors = torch.randint(0, S, (2, n), generator=g).sort(-1).values
    valid = torch.tensor([[True] * n, [True, True, False, False]])
    dense = bool_mask(anchors, valid, S, B, rule)[:, 0]  # [2, n*B, S + n*B]
    local = local_mask(anchors, valid, S, B, rule).mask  # [2, n, B, S + B]
    for blk in range(n):
        rows = dense[:, blk * B:(blk + 1) * B]
        own = list(range(S)) + list(range(S + blk * B, S + (blk + 1) * B))
        assert torch.equal(local[:, blk], rows[..., own])
        others = [k for k in range(S + n * B) if k not in own]
        assert not rows[..., others].any()  # nothing the local rendering leaves out was visible

"""The one mask predicate against a brute-force construction of SPEC's rule."""

import itertools
import shutil

import pytest
import torch

from pipeline.drafter.masks import LayerRule, allowed, block_mask, bool_mask


def brute(anchors, valid, S, B, rule, starts=None):
    """SPEC §2 written out: key layout [context 0..S-1 | block 0 | block 1 | ...]; a packed row's
    block sees only its own document's context (from starts[b, blk])."""
    batch, n = anchors.shape
    out = torch.zeros(batch, n * B, S + n * B, dtype=torch.bool)
    for b, q, kv in itertools.product(range(batch), range(n * B), range(S + n * B)):
        blk, j = divmod(q, B)
        a = int(anchors[b, blk])
        first = 0 if starts is None else int(starts[b, blk])
        q_pos = a + j
        if kv < S:
            ok, k_pos = bool(valid[b, blk]) and first <= kv < a, kv
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


RULES = [
    LayerRule(),
    LayerRule(causal=True),
    LayerRule(causal=True, window=5),
    LayerRule(causal=False, window=4),
    LayerRule(causal=True, window=1),
]


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


def packed_anchors(seed, S, n, docs=(0, 4, 9)):
    """Anchors of a packed row whose documents begin at `docs`, each anchor's document start beside it."""
    anchors, valid = random_anchors(seed, S, n)
    edges = torch.tensor(docs)
    starts = edges[torch.searchsorted(edges, anchors, right=True) - 1]
    return anchors, valid, starts


@pytest.mark.parametrize("rule", RULES, ids=str)
@pytest.mark.parametrize("seed", range(3))
def test_packed_rows_see_only_their_documents_context(rule, seed):
    from pipeline.drafter.masks import local_mask

    S, B, n = 13, 4, 6
    anchors, valid, starts = packed_anchors(seed, S, n)
    got = bool_mask(anchors, valid, S, B, rule, starts)[:, 0]
    assert torch.equal(got, brute(anchors, valid, S, B, rule, starts))
    if rule.window != 1:  # a window of 1 shows no context at all
        assert not torch.equal(got, bool_mask(anchors, valid, S, B, rule)[:, 0])  # the documents matter
    local = local_mask(anchors, valid, S, B, rule, starts).mask
    for blk in range(n):
        own = list(range(S)) + list(range(S + blk * B, S + (blk + 1) * B))
        assert torch.equal(local[:, blk], got[:, blk * B : (blk + 1) * B][..., own])


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
        one = allowed(
            torch.tensor(0),
            torch.tensor(q),
            torch.tensor(kv),
            anchors=anchors,
            valid=valid,
            ctx_len=8,
            block_size=4,
            rule=rule,
        )
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
        rows = dense[:, blk * B : (blk + 1) * B]
        own = list(range(S)) + list(range(S + blk * B, S + (blk + 1) * B))
        assert torch.equal(local[:, blk], rows[..., own])
        others = [k for k in range(S + n * B) if k not in own]
        assert not rows[..., others].any()  # nothing the local rendering leaves out was visible


# -- the flex BlockMask, built from the block structure --------------------------------------------

FLEX_RULES = RULES + [
    LayerRule(causal=True, window=2048),
    LayerRule(causal=False, window=40),
    LayerRule(causal=True, window=130),
]
BLOCKMASK_FIELDS = (
    "kv_num_blocks",
    "kv_indices",
    "full_kv_num_blocks",
    "full_kv_indices",
    "q_num_blocks",
    "q_indices",
    "full_q_num_blocks",
    "full_q_indices",
)


def reference_block_mask(anchors, valid, S, B, rule, starts=None):
    """torch's construction from the dense predicate (what masks.block_mask used to call)."""
    from torch.nn.attention.flex_attention import create_block_mask

    def mask_mod(b, _h, q, kv):
        return allowed(b, q, kv, anchors=anchors, valid=valid, ctx_len=S, block_size=B, rule=rule, starts=starts)

    batch, n = anchors.shape
    return create_block_mask(mask_mod, B=batch, H=None, Q_LEN=n * B, KV_LEN=S + n * B, device="cpu")


def random_anchors(seed, S, n, batch=2):
    """Sorted anchors in 1..S (some repeated when n is large), about one in five padded."""
    g = torch.Generator().manual_seed(seed)
    anchors = torch.randint(1, S + 1, (batch, n), generator=g).sort(-1).values
    anchors[:, -1] = S  # training's context length is the largest anchor
    valid = torch.rand(batch, n, generator=g) > 0.2
    return anchors, valid


SHAPES = [
    (16, 40, 300),
    (16, 24, 700),
    (8, 33, 515),
    (10, 29, 257),
    (3, 50, 129),
    (128, 3, 200),
    (200, 2, 90),
    (16, 1, 40),
]  # (B, N, S): S mostly not a multiple of 128, blocks straddling tiles for B=10 and 3


@pytest.mark.parametrize("rule", FLEX_RULES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_block_mask_is_what_create_block_mask_builds(rule, shape):
    from torch.nn.attention.flex_attention import create_mask

    B, n, S = shape
    for seed in range(2):
        anchors, valid = random_anchors(seed, S, n)
        ours, ref = block_mask(anchors, valid, S, B, rule), reference_block_mask(anchors, valid, S, B, rule)
        for name in BLOCKMASK_FIELDS:
            assert torch.equal(getattr(ours, name), getattr(ref, name)), name
        assert torch.equal(ours.to_dense(), ref.to_dense())
        assert ours.seq_lengths == ref.seq_lengths
        dense = create_mask(ours.mask_mod, 2, 1, n * B, S + n * B, device="cpu")
        assert torch.equal(dense, create_mask(ref.mask_mod, 2, 1, n * B, S + n * B, device="cpu"))
        assert torch.equal(dense, bool_mask(anchors, valid, S, B, rule))


@pytest.mark.parametrize("rule", FLEX_RULES, ids=str)
@pytest.mark.parametrize("shape", [(16, 40, 300), (10, 29, 257), (16, 1, 40)], ids=str)
def test_block_mask_of_packed_rows_is_what_create_block_mask_builds(rule, shape):
    B, n, S = shape
    for seed in range(2):
        anchors, valid, starts = packed_anchors(seed, S, n, docs=(0, S // 3, S // 3 + 7, S - 5))
        ours = block_mask(anchors, valid, S, B, rule, starts)
        ref = reference_block_mask(anchors, valid, S, B, rule, starts)
        for name in BLOCKMASK_FIELDS:
            assert torch.equal(getattr(ours, name), getattr(ref, name)), name


def tile_view(mask):
    """[batch, 1, Q, KV] bool, padded with False to whole tiles -> [batch, n_q, n_kv, TILE, TILE]."""
    from pipeline.drafter.masks import TILE

    batch, _, q, kv = mask.shape
    m = torch.nn.functional.pad(mask[:, 0], (0, -kv % TILE, 0, -q % TILE))
    return m.view(batch, m.shape[1] // TILE, TILE, m.shape[2] // TILE, TILE).transpose(2, 3)


@pytest.mark.parametrize("rule", FLEX_RULES, ids=str)
def test_block_mask_tiles_agree_with_the_dense_mask(rule):
    """Independently of torch's construction: a full tile is all allowed, a skipped tile has nothing
    allowed, a partial tile has both; and wide enough rules do produce full tiles."""
    B, n, S = 16, 48, 640
    anchors, valid = random_anchors(3, S, n)
    bm = block_mask(anchors, valid, S, B, rule)
    dense = tile_view(bool_mask(anchors, valid, S, B, rule))  # [batch, n_q, n_kv, TILE, TILE]
    kinds = torch.zeros(dense.shape[:3], dtype=torch.long)  # 0 skipped, 1 partial, 2 full
    for number, indices, kind in ((bm.kv_num_blocks, bm.kv_indices, 1), (bm.full_kv_num_blocks, bm.full_kv_indices, 2)):
        for b, t in itertools.product(range(dense.shape[0]), range(dense.shape[1])):
            kinds[b, t, indices[b, 0, t, : number[b, 0, t]].long()] = kind
    count = dense.sum((-1, -2))
    assert (count[kinds == 0] == 0).all()
    assert (count[kinds == 2] == dense.shape[-1] ** 2).all()
    assert ((count[kinds == 1] > 0) & (count[kinds == 1] < dense.shape[-1] ** 2)).all()
    assert (kinds == 1).any() and (kinds == 0).any()
    if rule.window is None or rule.window > 2 * dense.shape[-1]:  # narrower windows leave no tile whole
        assert (kinds == 2).any()


def flex_inputs(seed, S, n, B, heads=4, kv_heads=2, d=16):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, heads, n * B, d, generator=g)
    k, v = torch.randn(2, 2, kv_heads, S + n * B, d, generator=g)
    return q, k, v


@pytest.mark.parametrize(
    "rule", [LayerRule(), LayerRule(causal=True, window=100), LayerRule(causal=False, window=30)], ids=str
)
def test_flex_eager_forward_is_the_same_with_either_mask(rule):
    """Eager flex_attention on CPU evaluates the mask_mod over every (query, key), so this checks the
    mask_mod; the compiled test below checks the tile structure."""
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import flex_attention

    B, n, S = 16, 20, 300
    anchors, valid = random_anchors(5, S, n)
    q, k, v = flex_inputs(0, S, n, B)
    ours = flex_attention(q, k, v, block_mask=block_mask(anchors, valid, S, B, rule), enable_gqa=True)
    ref = flex_attention(q, k, v, block_mask=reference_block_mask(anchors, valid, S, B, rule), enable_gqa=True)
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=bool_mask(anchors, valid, S, B, rule), enable_gqa=True)
    assert torch.equal(ours, ref)
    assert torch.allclose(ours, sdpa, atol=1e-5)


@pytest.mark.skipif(
    shutil.which("g++") is None and shutil.which("c++") is None, reason="torch.compile needs a C++ compiler on CPU"
)
def test_compiled_flex_reads_the_tiles():
    """Compiled flex (CPU inductor) visits only the listed tiles and skips the mask_mod on full ones:
    with our BlockMask it gives the SDPA result, and dropping the full tiles changes it (so the
    kernel really reads the structure this test checks)."""
    import torch.nn.functional as F
    from torch.nn.attention.flex_attention import BlockMask, flex_attention

    B, n, S, rule = 16, 24, 600, LayerRule(causal=True, window=2048)
    anchors, valid = random_anchors(6, S, n)
    q, k, v = flex_inputs(1, S, n, B)
    bm = block_mask(anchors, valid, S, B, rule)
    assert int(bm.full_kv_num_blocks.sum()) > 0
    flex = torch.compile(flex_attention, dynamic=False)
    sdpa = F.scaled_dot_product_attention(q, k, v, attn_mask=bool_mask(anchors, valid, S, B, rule), enable_gqa=True)
    assert torch.allclose(flex(q, k, v, block_mask=bm, enable_gqa=True), sdpa, atol=1e-5)
    no_full = BlockMask.from_kv_blocks(
        bm.kv_num_blocks,
        bm.kv_indices,
        torch.zeros_like(bm.full_kv_num_blocks),
        bm.full_kv_indices,
        BLOCK_SIZE=bm.BLOCK_SIZE,
        mask_mod=bm.mask_mod,
        seq_lengths=bm.seq_lengths,
    )
    assert not torch.allclose(flex(q, k, v, block_mask=no_full, enable_gqa=True), sdpa, atol=1e-3)

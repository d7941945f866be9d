"""The drafter: released tensor names, strict context, training = one-block inference, RoPE, noise."""

import pytest
import torch

from pipeline.drafter import masks
from pipeline.drafter.blocks import make_blocks
from pipeline.drafter.checkpoint import expected_shapes
from tests.drafters import TAPS, B, H, V, config, drafter, run_blocks, sequence


def test_parameter_names_are_the_released_ones():
    m = drafter()
    state = m.state_dict()
    want = expected_shapes(m.config)
    assert {k: tuple(v.shape) for k, v in state.items()} == want
    assert "embed_tokens" not in state and "lm_head" not in state  # the target's, frozen, never saved
    assert want["fc.weight"] == (H, len(TAPS) * H)


@pytest.mark.parametrize(
    "layer_types,window", [(("full_attention",) * 2, None), (("sliding_attention", "full_attention"), 3)]
)
def test_training_blocks_equal_one_block_inference(layer_types, window):
    """Many overlapping blocks in one pass give what inference computes for each block alone, with
    the context cut right before its anchor (what a live round sees)."""
    m = drafter(config(layer_types=layer_types, sliding_window=window))
    hidden, tokens = sequence()
    anchors = [4, 6, 11, 12]
    together = run_blocks(m, hidden, tokens, anchors)
    for i, a in enumerate(anchors):
        alone = run_blocks(m, hidden, tokens, [a], ctx_len=a)
        assert torch.allclose(together[i], alone[0], atol=1e-5), a


def test_context_is_strictly_before_the_anchor():
    m = drafter()
    hidden, tokens = sequence()
    base = run_blocks(m, hidden, tokens, [8], ctx_len=20)
    later = hidden.clone()
    later[8:] = 5.0  # the anchor's own state and everything after it
    assert torch.equal(run_blocks(m, later, tokens, [8], ctx_len=20), base)
    earlier = hidden.clone()
    earlier[7] = 5.0
    assert not torch.allclose(run_blocks(m, earlier, tokens, [8], ctx_len=20), base)


def test_rope_is_relative_over_context_and_block():
    """One position tensor over [context ; block]: shifting every position changes nothing."""
    m = drafter()
    hidden, tokens = sequence()
    assert torch.allclose(
        run_blocks(m, hidden, tokens, [5, 9]), run_blocks(m, hidden, tokens, [5, 9], shift=37), atol=1e-4
    )


def test_sliding_layer_is_causal_inside_the_block():
    c = config(layer_types=("sliding_attention", "sliding_attention"), sliding_window=100)
    m = drafter(c)
    hidden, tokens = sequence()
    out = run_blocks(m, hidden, tokens, [6])
    tokens2 = tokens.clone()
    tokens2[6] = (tokens[6] + 1) % (V - 1)  # slot 0 changes: every slot sees it
    assert not torch.allclose(run_blocks(m, hidden, tokens2, [6])[0, 3], out[0, 3])
    bidir = drafter(config(layer_types=("sliding_attention",) * 2, sliding_window=100, is_causal=False))
    causal_first = run_blocks(m, hidden, tokens, [6])[0, 0]
    assert causal_first.shape == (H,) and not torch.allclose(run_blocks(bidir, hidden, tokens, [6])[0, 0], causal_first)


def test_partial_and_scaled_rope_build():
    for rope in (
        {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
        {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0},
    ):
        m = drafter(config(rope_parameters=rope))
        hidden, tokens = sequence()
        assert torch.isfinite(run_blocks(m, hidden, tokens, [5])).all()
    assert (
        drafter(
            config(rope_parameters={"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5})
        ).rotary.inv_freq.numel()
        == 2
    )


@pytest.mark.parametrize(
    "layer_types,window", [(("full_attention",) * 2, None), (("sliding_attention", "full_attention"), 2)]
)
def test_local_and_dense_sdpa_agree_forward_and_backward(layer_types, window):
    m = drafter(config(layer_types=layer_types, sliding_window=window))
    hidden, tokens = sequence()
    outs = []
    for kind in ("dense", "local"):
        m.zero_grad()
        anchors, valid = torch.tensor([[3, 3, 9, 0]]), torch.tensor([[True, True, True, False]])
        blk = make_blocks(tokens[None], torch.ones(1, len(tokens), dtype=torch.bool), anchors, valid, B, V - 1)
        mk = masks.build(m.rules, anchors, valid, 9, B, kind)
        h = m(hidden[None, :9], blk.block_ids, torch.arange(9)[None], blk.positions, mk)
        h.square().sum().backward()
        outs.append((h.detach(), m.fc.weight.grad.clone(), m.layers[0].self_attn.k_proj.weight.grad.clone()))
    for a, b in zip(*outs):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(
    "layer_types,window", [(("full_attention",) * 2, None), (("sliding_attention", "full_attention"), 2)]
)
def test_local_sdpa_over_rows_of_unequal_context_is_the_dense_result(layer_types, window):
    """Rows whose blocks see less than the padded context are attended over what they see only."""
    m = drafter(config(layer_types=layer_types, sliding_window=window))
    hidden, tokens = sequence()
    anchors = torch.tensor([[2, 4, 0], [3, 8, 11]])
    valid = torch.tensor([[True, True, False], [True, True, True]])
    lm = torch.ones(2, len(tokens), dtype=torch.bool)
    blk = make_blocks(torch.stack((tokens, tokens)), lm, anchors, valid, B, V - 1)
    ctx = torch.stack((hidden[:12], hidden[:12]))
    local = masks.build(m.rules, anchors, valid, 12, B, "local")
    assert all(r.contexts == [4, 11] for r in local.values())  # row 0 attends over 4 of 12 keys
    outs = []
    for mk in (masks.build(m.rules, anchors, valid, 12, B, "dense"), local):
        m.zero_grad()
        h = m(ctx, blk.block_ids, torch.arange(12).expand(2, 12), blk.positions, mk)
        (h * valid.repeat_interleave(B, 1)[..., None]).square().sum().backward()
        outs.append((h.detach(), m.fc.weight.grad.clone(), m.layers[0].self_attn.k_proj.weight.grad.clone()))
    keep = valid.repeat_interleave(B, 1)
    assert torch.allclose(outs[0][0][keep], outs[1][0][keep], atol=1e-5, rtol=1e-4)
    for a, b in zip(outs[0][1:], outs[1][1:]):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)


def test_flex_block_mask_gives_the_sdpa_result(monkeypatch):
    """The CUDA rendering of the predicate (a flex BlockMask) computes what the CPU paths compute.
    flex has no CPU backward, so this checks the forward pass, eagerly."""
    import warnings

    from torch.nn.attention.flex_attention import flex_attention

    from pipeline.drafter import attention

    monkeypatch.setattr(attention, "compiled_flex", lambda: flex_attention)
    m = drafter(config(layer_types=("sliding_attention", "full_attention"), sliding_window=3))
    hidden, tokens = sequence()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        outs = {kind: run_blocks(m, hidden, tokens, [4, 7, 7, 13], kind=kind) for kind in ("flex", "dense", "local")}
    assert torch.allclose(outs["flex"], outs["dense"], atol=1e-5)
    assert torch.allclose(outs["local"], outs["dense"], atol=1e-5)


def _grads(m, hidden, tokens, anchors):
    """Parameter gradients of a training-style forward (all anchors at once) under a fixed loss."""
    anchors_t = torch.tensor([anchors])
    valid = torch.ones_like(anchors_t, dtype=torch.bool)
    blk = make_blocks(tokens[None], torch.ones(1, len(tokens), dtype=torch.bool), anchors_t, valid, B, V - 1)
    S = int(anchors_t.max())
    mk = masks.build(m.rules, anchors_t, valid, S, B, "local")
    m.zero_grad()
    out = m(hidden[None, :S], blk.block_ids, torch.arange(S)[None], blk.positions, mk)
    (out.float() ** 2).mean().backward()
    return {n: p.grad.clone() for n, p in m.named_parameters()}


@pytest.mark.parametrize(
    "layer_types,window", [(("full_attention",) * 2, None), (("sliding_attention", "full_attention"), 3)]
)
def test_recomputed_layers_give_the_same_gradients(layer_types, window):
    """--grad-checkpoint: the layers' activations recomputed in the backward give every gradient bit
    for bit (the same operations in the same order, on CPU)."""
    m = drafter(config(layer_types=layer_types, sliding_window=window)).train()
    hidden, tokens = sequence()
    kept = _grads(m, hidden, tokens, [4, 6, 11, 12])
    m.checkpoint_layers = True
    again = _grads(m, hidden, tokens, [4, 6, 11, 12])
    assert kept.keys() == again.keys() and all(torch.equal(kept[n], again[n]) for n in kept)


def test_a_sliding_layer_sees_no_context_beyond_its_window_at_a_far_anchor():
    """Long context with sliding layers: at an anchor far past the window, the states older than the
    window change nothing; one inside it does."""
    window, anchor = 6, 40
    m = drafter(config(layer_types=("sliding_attention",) * 2, sliding_window=window))
    hidden, tokens = sequence(T=48)
    base = run_blocks(m, hidden, tokens, [anchor], ctx_len=anchor)
    old = hidden.clone()
    old[: anchor - window + 1] = 5.0  # every position at least `window` before the block's first slot
    assert torch.equal(run_blocks(m, old, tokens, [anchor], ctx_len=anchor), base)
    near = hidden.clone()
    near[anchor - window + 1] = 5.0  # the oldest position the block's first slot still sees
    assert not torch.allclose(run_blocks(m, near, tokens, [anchor], ctx_len=anchor)[0, 0], base[0, 0])

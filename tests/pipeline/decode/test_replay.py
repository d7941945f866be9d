"""Replay: the cached drafter equals the training computation round by round; rounds add up."""

import torch

from pipeline.decode.session import DraftSession
from pipeline.drafter import masks
from store.shard_reader import Sample
from tests.drafters import TAPS, B, H, V, config, drafter
from tests.pipeline.decode.reference_replay import chain, replay


def sample(T=40, P=9, seed=0) -> Sample:
    g = torch.Generator().manual_seed(seed)
    lm = torch.zeros(T, dtype=torch.bool)
    lm[P:] = True
    return Sample(
        shard=0,
        index=0,
        row_id=0,
        tokens=torch.randint(0, V - 1, (T,), generator=g),
        loss_mask=lm,
        prompt_len=P,
        hidden=torch.randn(T, len(TAPS), H, generator=g).to(torch.bfloat16),
    )


def uncached_logits(m, s: Sample, start: int) -> torch.Tensor:
    """What training computes for one block anchored at `start` with the context cut there."""
    ids = torch.full((1, B), V - 1)
    ids[0, 0] = s.tokens[start]
    anchors = torch.tensor([[start]])
    mk = masks.build(m.rules, anchors, torch.ones_like(anchors, dtype=torch.bool), start, B, "dense")
    with torch.no_grad():
        h = m(s.hidden[None, :start], ids, torch.arange(start)[None], torch.arange(start, start + B)[None], mk)
        return m.logits(h[0, 1:])


def test_cached_drafting_equals_the_training_computation():
    m = drafter(config(layer_types=("sliding_attention", "full_attention"), sliding_window=6))
    s = sample()
    starts = []

    def checking(logits, target):
        start = s.prompt_len + sum(t for _, t in rounds_so_far)
        starts.append(start)
        assert torch.allclose(logits, uncached_logits(m, s, start), atol=1e-5)
        acc = chain(logits, target)
        rounds_so_far.append((acc, min(acc + 1, len(s.tokens) - 1 - start)))
        return acc

    rounds_so_far = []
    out = replay(m, s, checking)
    assert out.rounds == rounds_so_far and len(starts) == len(out.rounds) > 3


def test_rounds_add_up_and_the_last_is_cut():
    s = sample(T=30, P=5)
    m = drafter()
    everything = replay(m, s, lambda logits, target: len(target))  # every draft accepted
    assert [t for _, t in everything.rounds] == [B, B, B, B, B, 4]  # 24 tokens after the first one
    nothing = replay(m, s, lambda logits, target: 0)
    assert [t for _, t in nothing.rounds] == [1] * 24
    capped = replay(m, s, lambda logits, target: 0, max_rounds=3)
    assert len(capped.rounds) == 3


def test_session_extends_in_pieces_like_at_once():
    m = drafter()
    s = sample()
    a, b = DraftSession(m), DraftSession(m)
    a.extend(s.hidden[:20])
    for lo in range(0, 20, 7):
        b.extend(s.hidden[lo : min(20, lo + 7)])
    assert torch.allclose(a.draft(3), b.draft(3), atol=1e-5)

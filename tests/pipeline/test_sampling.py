"""pipeline/sampling.py: each row's seed and noise, and one sampling step: the distribution it draws
from (temperature, top-k, top-p), and that a row's token does not depend on the rows beside it."""

import pytest
import torch

from pipeline.sampling import RowSampler, draw, mix64, row_seed, step_key, uniforms
from store.format.schema import Sampling

ROWS = 100_000  # draws of one distribution, each with noise of its own: shares within ~5 standard errors


def shares(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """The share of each token among ROWS draws from one row of logits [V], each row another seed."""
    u = uniforms([step_key(row_seed(0, r), 0) for r in range(ROWS)], logits.shape[-1])
    tokens = draw(logits.expand(ROWS, -1), u, sampling)
    return torch.bincount(tokens, minlength=logits.shape[-1]).double() / ROWS


def test_the_noise_is_a_fixed_function_of_seed_step_and_token_on_every_device():
    """The int64 tensor hash equals the reference on Python integers, bit for bit (wrapping products)."""
    keys = [0, 1, 2**63 - 1, 2**64 - 1, step_key(row_seed(5, 7), 3)]
    u = uniforms(keys, 300)
    for i, k in enumerate(keys):
        for j in (0, 1, 150, 299):
            bits = mix64((k + j * 0x9E3779B97F4A7C15) & (2**64 - 1)) >> 12
            assert u[i, j].item() == (bits + 0.5) / 2**52, (k, j)
    assert bool(((u > 0) & (u < 1)).all()) and abs(u.mean().item() - 0.5) < 0.01
    assert len({row_seed(s, r) for s in range(3) for r in range(1000)}) == 3000 and row_seed(0, 5) < 2**63
    assert torch.equal(uniforms(keys[1:3], 300), u[1:3])  # a row's noise, whatever rows come with it


def test_a_draw_follows_the_tempered_distribution():
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0, 0.0])
    for t in (0.5, 1.0, 2.0):
        want = (logits.double() / t).softmax(-1)
        assert torch.allclose(shares(logits, Sampling(temperature=t)), want, atol=0.007), t


def test_top_k_keeps_the_k_most_likely_renormalized():
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0, 0.0])
    got = shares(logits, Sampling(temperature=1.0, top_k=2))
    want = torch.zeros(5, dtype=torch.float64)
    want[:2] = logits[:2].double().softmax(-1)
    assert torch.allclose(got, want, atol=0.007) and got[2:].sum() == 0


@pytest.mark.parametrize(
    "top_p,kept", [(0.4, [0]), (0.6, [0, 1]), (0.79, [0, 1]), (0.81, [0, 1, 2]), (1.0, [0, 1, 2, 3])]
)
def test_top_p_keeps_the_smallest_most_likely_set_reaching_it(top_p, kept):
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    got = shares(probs.log(), Sampling(temperature=1.0, top_p=top_p))
    want = torch.zeros(4, dtype=torch.float64)
    want[kept] = probs[kept] / probs[kept].sum()
    assert torch.allclose(got, want, atol=0.007), (top_p, got)
    assert got[[i for i in range(4) if i not in kept]].sum() == 0


def test_a_rows_token_does_not_depend_on_the_rows_beside_it():
    torch.manual_seed(0)
    logits = torch.randn(8, 1000) * 3
    u = uniforms([step_key(row_seed(0, r), 0) for r in range(8)], 1000)
    s = Sampling(temperature=0.8, top_p=0.9, top_k=50)
    batch = draw(logits, u, s)
    alone = torch.cat([draw(logits[i : i + 1], u[i : i + 1], s) for i in range(8)])
    assert torch.equal(batch, alone)
    assert torch.equal(draw(logits.flip(0), u.flip(0), s), batch.flip(0))


def test_the_processor_leaves_each_row_its_own_draw_at_its_step():
    """generate's argmax then takes the drawn token; the step is the width beyond the padded prompt."""
    torch.manual_seed(1)
    s, seeds, width = Sampling(temperature=1.0), [row_seed(0, 3), row_seed(0, 9)], 7
    scores = torch.randn(2, 50)
    out = RowSampler(s, seeds, width)(torch.zeros(2, width + 2, dtype=torch.long), scores.clone())
    want = draw(scores, uniforms([step_key(seeds[0], 2), step_key(seeds[1], 2)], 50), s)
    assert torch.equal(out.argmax(-1), want) and torch.isfinite(out).sum(-1).tolist() == [1, 1]


def test_a_batch_wider_than_a_chunk_draws_each_row_as_alone(monkeypatch):
    monkeypatch.setattr(RowSampler, "ROWS", 3)
    torch.manual_seed(2)
    s, seeds, width = Sampling(temperature=0.9, top_k=40), [row_seed(1, r) for r in range(8)], 5
    scores, ids = torch.randn(8, 300), torch.zeros(8, width + 1, dtype=torch.long)
    batch = RowSampler(s, seeds, width)(ids, scores.clone()).argmax(-1)
    alone = [RowSampler(s, [seeds[i]], width)(ids[i : i + 1], scores[i : i + 1].clone()).argmax(-1) for i in range(8)]
    assert torch.equal(batch, torch.cat(alone))

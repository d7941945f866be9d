"""pipeline/sampling.py: each row's seed and draws, and one sampling step: the distribution it draws
from (temperature, top-k, top-p), and that a row's token does not depend on the rows beside it."""

import pytest
import torch

from pipeline.sampling import RowSampler, draw, row_seed, uniform
from store.format.schema import Sampling

GRID = 20_000  # draws at evenly spaced uniforms: each token's share is its probability within 1/GRID


def shares(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """The share of each token among draws at GRID evenly spaced uniforms, one row of logits [V]."""
    u = (torch.arange(GRID, dtype=torch.float64) + 0.5) / GRID
    tokens = draw(logits.expand(GRID, -1), u, sampling)
    return torch.bincount(tokens, minlength=logits.shape[-1]).double() / GRID


def test_row_seeds_and_draws_are_fixed_functions_of_seed_row_and_step():
    assert row_seed(0, 5) == row_seed(0, 5) and 0 <= row_seed(0, 5) < 2**63
    assert len({row_seed(s, r) for s in range(3) for r in range(100)}) == 300  # no two rows or seeds alike
    draws = [uniform(row_seed(0, 5), k) for k in range(1000)]
    assert all(0 <= u < 1 for u in draws) and len(set(draws)) == 1000
    assert abs(sum(draws) / 1000 - 0.5) < 0.05
    assert uniform(row_seed(0, 5), 3) == draws[3]


def test_a_draw_follows_the_tempered_distribution():
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0, 0.0])
    for t in (0.5, 1.0, 2.0):
        want = (logits.double() / t).softmax(-1)
        assert torch.allclose(shares(logits, Sampling(temperature=t)), want, atol=2 / GRID), t


def test_top_k_keeps_the_k_most_likely_renormalized():
    logits = torch.tensor([2.0, 1.0, 0.5, -1.0, 0.0])
    got = shares(logits, Sampling(temperature=1.0, top_k=2))
    want = torch.zeros(5, dtype=torch.float64)
    want[:2] = logits[:2].double().softmax(-1)
    assert torch.allclose(got, want, atol=2 / GRID)


@pytest.mark.parametrize(
    "top_p,kept", [(0.4, [0]), (0.6, [0, 1]), (0.79, [0, 1]), (0.81, [0, 1, 2]), (1.0, [0, 1, 2, 3])]
)
def test_top_p_keeps_the_smallest_most_likely_set_reaching_it(top_p, kept):
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05], dtype=torch.float64)
    got = shares(probs.log(), Sampling(temperature=1.0, top_p=top_p))
    want = torch.zeros(4, dtype=torch.float64)
    want[kept] = probs[kept] / probs[kept].sum()
    assert torch.allclose(got, want, atol=2 / GRID), (top_p, got)


def test_a_rows_token_does_not_depend_on_the_rows_beside_it():
    torch.manual_seed(0)
    logits = torch.randn(8, 1000) * 3
    u = torch.rand(8, dtype=torch.float64)
    s = Sampling(temperature=0.8, top_p=0.9, top_k=50)
    batch = draw(logits, u, s)
    alone = torch.cat([draw(logits[i : i + 1], u[i : i + 1], s) for i in range(8)])
    assert torch.equal(batch, alone)
    assert torch.equal(draw(logits.flip(0), u.flip(0), s), batch.flip(0))


def test_the_processor_leaves_each_row_its_own_draw_at_its_step():
    """generate's argmax then takes the drawn token; the step is the width beyond the padded prompt."""
    torch.manual_seed(1)
    s, seeds, width = Sampling(temperature=1.0), [row_seed(0, 3), row_seed(0, 9)], 7
    sampler = RowSampler(s, seeds, width, steps=4)
    scores = torch.randn(2, 50)
    out = sampler(torch.zeros(2, width + 2, dtype=torch.long), scores.clone())
    u = torch.tensor([uniform(seeds[0], 2), uniform(seeds[1], 2)], dtype=torch.float64)
    want = draw(scores, u, s)
    assert torch.equal(out.argmax(-1), want) and torch.isfinite(out).sum(-1).tolist() == [1, 1]

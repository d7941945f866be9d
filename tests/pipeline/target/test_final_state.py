"""The final state's check: positions, argmax in fp32, unit RMS under the norm's gain, and the refusals."""

from types import SimpleNamespace

import pytest
import torch

from pipeline.errors import TargetError
from pipeline.target import final_state
from store.format.schema import Sampling


def test_completion_positions_are_the_states_before_each_completion_token():
    pos, nxt = final_state.completion_positions([5, 3], [3, 1])  # rows of 5 (prompt 3) and 3 (prompt 1)
    assert pos.tolist() == [2, 3, 5, 6] and nxt.tolist() == [3, 4, 6, 7]


def test_argmax_matches_counts_the_hits_chunk_by_chunk(monkeypatch):
    monkeypatch.setattr(final_state, "CHUNK", 2)
    head = torch.eye(4, dtype=torch.bfloat16)  # logits = the state itself
    states = torch.tensor([[0, 1, 0, 0], [1, 0, 0, 0], [0, 0, 0, 2], [0, 0, 3, 0], [1, 0, 0, 0]], dtype=torch.bfloat16)
    assert final_state.argmax_matches(states, head, torch.tensor([1, 0, 3, 0, 0])) == 4


def test_normed_counts_states_of_unit_rms_under_the_gain():
    gain = torch.full((4,), 2.0)
    states = torch.tensor([[2, -2, 2, 2], [2.1, 2, 2, 2], [4, 4, 4, 4], [0.2, 0.2, 0.2, 0.2]]).to(torch.bfloat16)
    assert final_state.normed(states, gain) == 2  # rms 1 and 1.0125; not 2, not 0.1


def check(matches=100, tokens=100, normed=50, states=50) -> dict:
    return {"matches": matches, "tokens": tokens, "normed": normed, "states": states}


def made(responses: str, sampling=None):
    """The fields of a store's compat record the check reads."""
    return SimpleNamespace(responses=responses, sampling=sampling)


def test_require_refuses_a_low_rate_on_greedy_references_only():
    final_state.require(check(matches=90), "s: shard 3", made("regenerate"))  # at the threshold
    with pytest.raises(TargetError, match=r"^s: shard 3: argmax of lm_head\(final state\) .* for 89\.0% of 100 "):
        final_state.require(check(matches=89), "s: shard 3", made("server"))
    final_state.require(check(matches=10), "s: shard 3", made("dataset"))  # reported, not enforced
    sampled = Sampling(temperature=1.0, top_p=None, top_k=None, seed=0)
    final_state.require(check(matches=10), "s: shard 3", made("regenerate", sampled))  # sampled: reported only
    final_state.require(check(matches=0, tokens=0), "s: shard 3", made("regenerate"))  # nothing to check


def test_require_refuses_states_not_of_unit_rms_whatever_the_references():
    final_state.require(check(normed=99, states=100), "s: shard 1", made("regenerate"))
    for responses in ("regenerate", "dataset"):
        with pytest.raises(TargetError, match=r"^s: shard 1: only 98 of 100 final states \(98\.0%\) have unit RMS"):
            final_state.require(check(normed=98, states=100), "s: shard 1", made(responses))

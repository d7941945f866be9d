"""Batched replay gives every prompt the rounds of the one-prompt reference (replay.py), for chain
and DDTree lanes alike, whatever the slot count; the exact top-K on the device equals ddtree.top_k."""

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pipeline.decode import ddtree
from pipeline.decode.batch_replay import BatchReplay
from pipeline.decode.sampled_acceptance import expected_tokens, slot_acceptance
from pipeline.drafter.model import Drafter
from pipeline.errors import DrafterError
from store.shard_reader import Sample
from tests.drafters import TAPS, H, config
from tests.pipeline.decode import reference_replay as replay

V = 6  # a small vocabulary: drafts are often accepted, so rounds are long and varied


def small_drafter(**over) -> Drafter:
    g = torch.Generator().manual_seed(0)
    m = Drafter(
        config(vocab_size=V, mask_token_id=V - 1, **over),
        torch.randn(V, H, generator=g),
        torch.randn(V, H, generator=g),
    )
    m.init_weights(torch.Generator().manual_seed(1), std=0.3)
    return m.eval()


def samples(n: int, seed: int = 0, one_token: tuple[int, ...] = ()) -> list[Sample]:
    """n random samples; those numbered in one_token have a one-token completion (no round)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        T = int(torch.randint(8, 40, (1,), generator=g))
        P = T - 1 if i in one_token else int(torch.randint(1, T - 1, (1,), generator=g))
        mask = torch.zeros(T, dtype=torch.bool)
        mask[P:] = True
        out.append(
            Sample(
                shard=i % 3,
                index=i,
                row_id=100 + i,
                tokens=torch.randint(0, V - 1, (T,), generator=g),
                loss_mask=mask,
                prompt_len=P,
                hidden=torch.randn(T, len(TAPS), H, generator=g).bfloat16(),
            )
        )
    return out


def serial(m, ss, budgets, max_rounds=None):
    policies = [replay.chain, *(replay.tree(b) for b in budgets)]
    return {(s.shard, s.index): [replay.replay(m, s, p, max_rounds).rounds for p in policies] for s in ss}


@pytest.mark.parametrize("slots", [1, 3, 8])
@pytest.mark.parametrize("layers", [("full_attention",) * 2, ("sliding_attention", "full_attention")])
def test_batched_rounds_equal_the_serial_reference(slots, layers):
    m = small_drafter(layer_types=layers, sliding_window=5)
    ss, budgets = samples(11), (2, 4, 8)
    want = serial(m, ss, budgets)
    engine = BatchReplay(m, budgets, slots=slots, capacity=40)
    got = {(c.shard, c.index): c for c in engine.run(ss, keep_rounds={(s.shard, s.index) for s in ss})}
    assert set(got) == set(want)
    for key, rounds in want.items():
        c = got[key]
        assert c.chain_rounds == rounds[0]
        assert c.rounds == [len(r) for r in rounds] and c.tokens == [sum(t for _, t in r) for r in rounds]
    accepted = [a for r in want.values() for lane in r for a, _ in lane]
    assert max(accepted) >= 2 and min(accepted) == 0  # the comparison is not trivial
    hist = [[0] * 4 for _ in range(4)]
    for r in want.values():
        for lane, rounds in enumerate(r):
            for a, _ in rounds:
                hist[lane][a] += 1
    assert engine.histogram == hist


def test_max_rounds_and_kept_rounds():
    m, ss = small_drafter(), samples(5, seed=2)
    want = serial(m, ss, (4,), max_rounds=2)
    got = list(BatchReplay(m, (4,), slots=2, capacity=40, max_rounds=2).run(ss, keep_rounds={(ss[0].shard, 0)}))
    assert sorted(c.index for c in got) == list(range(5))
    for c in got:
        assert c.rounds == [len(r) for r in want[(c.shard, c.index)]] and max(c.rounds) <= 2
        assert (c.chain_rounds is not None) == (c.index == 0)


@pytest.mark.parametrize("slots", [1, 2, 5])
def test_prompts_that_need_no_round_are_counted_and_free_their_slot(slots):
    m, ss = small_drafter(), samples(9, seed=4, one_token=(0, 1, 2, 5, 8))
    want = serial(m, ss, (4,))
    got = {(c.shard, c.index): c for c in BatchReplay(m, (4,), slots=slots, capacity=40).run(ss)}
    assert set(got) == set(want)
    for key, rounds in want.items():
        assert got[key].rounds == [len(r) for r in rounds]
    assert sum(c.rounds == [0, 0] for c in got.values()) == 5


def test_a_sample_longer_than_the_cache_is_refused():
    with pytest.raises(ValueError, match="cache holds 10"):
        list(BatchReplay(small_drafter(), (), slots=1, capacity=10).run(samples(3)))


def test_device_top_k_equals_the_reference_with_ties():
    g = torch.Generator().manual_seed(0)
    lp = torch.log_softmax(torch.randint(0, 4, (40, 30), generator=g).float(), -1)  # many ties at every cut
    for k in (1, 3, 7, 30):
        vals, ids = ddtree.top_k_device(lp, k)
        ref_v, ref_i = ddtree.top_k(lp, k)
        assert ids.tolist() == ref_i and np.allclose(vals.numpy(), ref_v, rtol=0, atol=0)


def dspark_drafter() -> Drafter:
    m = small_drafter(head="dspark", markov_rank=3)
    with torch.no_grad():  # a head that biases (markov_w2 starts at zero)
        m.markov_head.markov_w2.weight.copy_(torch.randn(V, 3, generator=torch.Generator().manual_seed(5)) * 3)
    return m


def dspark_reference(m: Drafter, s: Sample) -> list[tuple[int, int]]:
    """One prompt's chain rounds, drafting slot after slot by hand from the session's base logits."""
    w1, w2 = m.markov_head.markov_w1.weight, m.markov_head.markov_w2.weight
    rounds, start, T = [], s.prompt_len, len(s.tokens)
    session = replay.DraftSession(m)
    session.extend(s.hidden[:start])
    while start < T - 1:
        base, prev, drafts = session.draft(int(s.tokens[start])), int(s.tokens[start]), []
        for k in range(m.config.block_size - 1):
            prev = int((base[k] + (w2 @ w1[prev]).to(base.dtype)).argmax())
            drafts.append(prev)
        acc = replay.accepted(drafts, s.tokens[start + 1 : start + m.config.block_size].tolist())
        n = replay.round_tokens(acc, T - 1 - start)
        rounds.append((acc, n))
        session.extend(s.hidden[start : start + n])
        start += n
    return rounds


@pytest.mark.parametrize("slots", [1, 4])
def test_a_dspark_drafters_chain_drafts_slot_after_slot(slots):
    m, ss = dspark_drafter(), samples(7, seed=4)
    got = {(c.shard, c.index): c for c in BatchReplay(m, (), slots, 40).run(ss, {(s.shard, s.index) for s in ss})}
    plain = {(s.shard, s.index): replay.replay(m, s).rounds for s in ss}  # the backbone's argmax alone
    for s in ss:
        assert got[(s.shard, s.index)].chain_rounds == dspark_reference(m, s)
    assert any(got[k].chain_rounds != plain[k] for k in plain)  # the head changed some rounds


def test_ddtree_with_a_dspark_drafter_is_refused_in_one_line():
    with pytest.raises(DrafterError, match="--ddtree: a dspark drafter .* pass --ddtree none"):
        BatchReplay(dspark_drafter(), (8,), 1, 40)


def with_final_states(ss: list[Sample], seed: int = 9) -> list[Sample]:
    """The samples with random final states (the target's p at a temperature comes from them)."""
    g = torch.Generator().manual_seed(seed)
    return [dataclasses.replace(s, final_state=torch.randn(len(s.tokens), H, generator=g)) for s in ss]


def dspark_expected_tokens(m: Drafter, s: Sample, T: float) -> tuple[float, float]:
    """One prompt's expected tokens at T over its greedy chain rounds, by hand, with sampled drafts and with
    greedy ones: slot i's drafter logits are the base's plus the bias of the reference's token before it, the
    target's p from the final state before the slot's own token (clamped as BatchReplay clamps it); a greedy
    draft (slot after slot, each biased by the draft before it) is accepted with probability p(draft)."""
    w1, w2 = m.markov_head.markov_w1.weight, m.markov_head.markov_w2.weight
    session, total, greedy = replay.DraftSession(m), 0.0, 0.0
    session.extend(s.hidden[: s.prompt_len])
    D, n = m.config.block_size - 1, len(s.tokens)
    for start, (acc, tokens) in zip(round_starts(s, dspark_reference(m, s)), dspark_reference(m, s)):
        base = session.draft(int(s.tokens[start]))  # [D, V]
        at = [min(start + k, n - 2) for k in range(D)]
        prev = [int(s.tokens[min(start + k, n - 1)]) for k in range(D)]
        q = torch.stack([base[k] + w2 @ w1[prev[k]] for k in range(D)])
        p = F.linear(s.final_state[at].float(), m.lm_head.float())
        alpha = slot_acceptance(p, q, T).tolist()
        total += expected_tokens(alpha, n - 1 - start)
        drafts, before = [], int(s.tokens[start])
        for k in range(D):
            before = int((base[k] + w2 @ w1[before]).argmax())
            drafts.append(before)
        chance = torch.softmax(p / T, -1).gather(1, torch.tensor(drafts)[:, None])[:, 0]
        greedy += expected_tokens(chance.tolist(), n - 1 - start)
        session.extend(s.hidden[start : start + tokens])
    return total, greedy


def round_starts(s: Sample, rounds: list[tuple[int, int]]) -> list[int]:
    starts, at = [], s.prompt_len
    for _, n in rounds:
        starts.append(at)
        at += n
    return starts


@pytest.mark.parametrize("slots", [1, 4])
def test_a_dspark_drafters_tau_at_temperature_biases_each_slot_by_the_reference_token_before_it(slots):
    m, ss = dspark_drafter(), with_final_states(samples(6, seed=4))
    got = {(c.shard, c.index): c for c in BatchReplay(m, (), slots, 40, temperature=1.0).run(ss)}
    plain = BatchReplay(small_drafter(), (), slots, 40, temperature=1.0).run(ss)  # the same backbone, no head
    for s in ss:
        c = got[(s.shard, s.index)]
        sampled, greedy = dspark_expected_tokens(m, s, 1.0)
        assert c.sampled_tokens == pytest.approx(sampled, rel=1e-5) and c.greedy_drafts == pytest.approx(
            greedy, rel=1e-5
        )
        assert c.rounds[0] == len(dspark_reference(m, s))  # the rounds stay greedy's
    assert {(c.shard, c.index): c.sampled_tokens for c in plain} != {k: c.sampled_tokens for k, c in got.items()}

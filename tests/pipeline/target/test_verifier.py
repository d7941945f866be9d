"""LiveTarget: live greedy speculative decoding yields the target's own greedy output, its tap
states are the target's, and commit(n) rolls back the hybrid cache exactly, the Gated DeltaNet
conv and recurrent states included."""

from __future__ import annotations

import pytest
import torch

from pipeline.target.verifier import LiveTarget
from store.errors import ConfigError
from tests.targets import bf16_close, prompt_ids, reference_states

TAPS = [0, 3, 4, 7]  # linear, attention, linear, the last layer (attention) of the tiny target
LIMIT = 40  # max new tokens
PROMPTS = 4  # the first shipped prompts; two of them stop at EOS before LIMIT


# -- the greedy speculative loop (SPEC §2, Evaluation) ----------------------------------------


def speculate(live: LiveTarget, prompt: list[int], draft, block: int, limit: int, eos: list[int]):
    """Greedy speculative decoding with `draft(out, k) -> k tokens`.

    Returns the new tokens (cut at EOS / limit), the tap states of every position the target
    processed [P + len(tokens) - 1, n_taps, H], and the acceptance count of each round."""
    token, states = live.prefill(torch.tensor(prompt))
    out, kept, accs = [token], [states], []
    while out[-1] not in eos and len(out) < limit:
        ids = [out[-1]] + draft(out, block - 1)
        posterior, states = live.verify(torch.tensor(ids))  # posterior: [B]; states: [B, n_taps, H]
        acc = 0
        while acc < block - 1 and ids[acc + 1] == posterior[acc]:
            acc += 1
        live.commit(acc + 1)
        assert live.length == len(prompt) + len(out) + acc
        kept.append(states[: acc + 1])
        accs.append(acc)
        for t in ids[1 : acc + 1] + [int(posterior[acc])]:
            if out[-1] in eos or len(out) == limit:
                break
            out.append(t)
    processed = len(prompt) + len(out) - 1  # the last token is never run through the target
    return out, torch.cat(kept)[:processed], accs


def oracle(truth: list[int]):
    """The true greedy continuation; a wrong token once it is exhausted."""

    def draft(out, k):
        return [truth[i] if i < len(truth) else wrong(truth, i) for i in range(len(out), len(out) + k)]

    return draft


def rejected(truth: list[int], seed: int = 0):
    """Random tokens, never the true one: every round accepts nothing."""
    gen = torch.Generator().manual_seed(seed)

    def draft(out, k):
        picks = torch.randint(0, 4096, (k,), generator=gen).tolist()
        return [
            p if i >= len(truth) or p != truth[i] else wrong(truth, i)
            for i, p in zip(range(len(out), len(out) + k), picks)
        ]

    return draft


def partly_right(truth: list[int]):
    """Right for j slots, then wrong; j = 0, 1, 2, ... cycling over rounds, so every commit size occurs."""
    rounds = [0]

    def draft(out, k):
        j = rounds[0] % (k + 1)
        rounds[0] += 1
        good = oracle(truth)(out, k)[:j]
        return good + [wrong(truth, i) for i in range(len(out) + j, len(out) + k)]

    return draft


def wrong(truth: list[int], i: int) -> int:
    return (truth[i] + 1) % 4096 if i < len(truth) else 1


DRAFTERS = {"oracle": oracle, "rejected": rejected, "partly_right": partly_right}


@pytest.fixture(scope="module")
def cases(target):
    """(prompt, greedy reference from Target.generate, a longer greedy continuation to draft from)."""
    out = []
    for p in prompt_ids(target, PROMPTS):
        ref = target.generate([p], [LIMIT])[0]
        longer = target.generate([p], [LIMIT + 16])[0]
        out.append((p, ref, longer))
    return out


@pytest.mark.parametrize("block", [4, 16])
@pytest.mark.parametrize("drafter", sorted(DRAFTERS))
def test_committed_tokens_are_the_greedy_generation(target, cases, drafter, block):
    assert any(len(ref) < LIMIT for _, ref, _ in cases) and any(len(ref) == LIMIT for _, ref, _ in cases)
    for prompt, ref, longer in cases:
        live = LiveTarget(target, TAPS)
        got, _, accs = speculate(live, prompt, DRAFTERS[drafter](longer), block, LIMIT, target.eos_ids)
        assert got == ref
        if drafter == "rejected":
            assert set(accs) == {0}
        if drafter == "oracle" and len(accs) > 1:
            assert set(accs[:-1]) == {block - 1}  # full blocks until the end


def test_partly_right_drafts_exercise_every_commit_size(target, cases):
    prompt, _, longer = cases[0]
    _, _, accs = speculate(LiveTarget(target, TAPS), prompt, partly_right(longer), 4, LIMIT, target.eos_ids)
    assert set(accs) == {0, 1, 2, 3}


@pytest.mark.parametrize("drafter", ["oracle", "partly_right"])
def test_tap_states_are_the_targets_over_the_full_sequence(target, cases, drafter):
    for prompt, ref, longer in cases[:2]:
        live = LiveTarget(target, TAPS)
        got, states, _ = speculate(live, prompt, DRAFTERS[drafter](longer), 4, LIMIT, target.eos_ids)
        seq = prompt + got[:-1]
        assert states.shape == (len(seq), len(TAPS), target.hidden_size) and states.dtype == torch.float32
        hs = reference_states(target, seq)  # fp32; hs[k + 1] is the output of layer k ...
        final_norm = target.model.get_decoder().norm  # ... but the last entry has the final norm applied
        for j, k in enumerate(TAPS):
            mine = final_norm(states[:, j]) if k == target.num_layers - 1 else states[:, j]
            assert torch.allclose(mine, hs[k + 1][0], atol=1e-4, rtol=0), f"tap {k}"
            assert not torch.allclose(states[:, j], hs[k][0], atol=1e-2), f"tap {k} also matches layer {k - 1}"
        assert bf16_close(target.capture([seq], TAPS), states)  # Target.capture keeps bf16


# -- exact rollback ---------------------------------------------------------------------------

B = 8


def linear_states(live: LiveTarget) -> dict:
    """(layer, kind) -> the cache's live linear-attention tensor."""
    return {
        (i, kind): get(i)
        for i in live._linear_layers()
        for kind, get in (("conv", live.cache.get_conv_state), ("recurrent", live.cache.get_recurrent_state))
    }


def layer_lengths(live: LiveTarget) -> list[int]:
    """Every cache layer's own token count: the attention layers' KV length, and (transformers >= 5.25)
    the linear layers' own count; -1 for a layer that keeps none. `cache.get_seq_length()` reads one
    layer only (the first attention layer before 5.25, the first layer, linear, since)."""
    return [int(layer.get_seq_length()) if hasattr(layer, "get_seq_length") else -1 for layer in live.cache.layers]


def keeps_own_counts(target) -> bool:
    live = LiveTarget(target, TAPS)
    live.prefill(torch.tensor(prompt_ids(target, 1)[0]))
    return all(n >= 0 for n in layer_lengths(live))


def rollback_errors(target, cls, n: int) -> dict:
    """Verify a random block of B, commit(n), verify another block; compare everything against a
    fresh LiveTarget that prefilled exactly the committed tokens. Returns max abs errors by name."""
    prompt = prompt_ids(target, 1)[0]
    gen = torch.Generator().manual_seed(n)
    block, nxt = torch.randint(0, 4096, (B,), generator=gen), torch.randint(0, 4096, (6,), generator=gen)
    live = cls(target, TAPS)
    live.prefill(torch.tensor(prompt))
    live.verify(block)
    live.commit(n)
    fresh = LiveTarget(target, TAPS)
    fresh.prefill(torch.tensor(prompt + block[:n].tolist()))
    assert live.length == fresh.length == len(prompt) + n
    errors = {
        "kv_length": max(abs(a - b) for a, b in zip(layer_lengths(live), layer_lengths(fresh))),
        "seq_length": abs(int(live.cache.get_seq_length()) - int(fresh.cache.get_seq_length())),
    }
    mine, theirs = linear_states(live), linear_states(fresh)
    for kind in ("conv", "recurrent"):
        errors[kind] = max((mine[key] - theirs[key]).abs().max().item() for key in mine if key[1] == kind)
    post, states = live.verify(nxt)
    post_fresh, states_fresh = fresh.verify(nxt)
    errors["states"] = (states - states_fresh).abs().max().item()
    errors["argmax"] = int((post != post_fresh).sum())
    return errors


@pytest.mark.parametrize("n", [1, 3, B - 1, B])
def test_commit_then_verify_equals_a_fresh_target_on_the_committed_tokens(target, n):
    errors = rollback_errors(target, LiveTarget, n)
    assert errors["kv_length"] == 0 and errors["seq_length"] == 0 and errors["argmax"] == 0
    assert errors["conv"] < 1e-5 and errors["recurrent"] < 1e-5 and errors["states"] < 1e-4, errors


class KeepsConv(LiveTarget):
    """Mutation: restores the recurrent state but not the conv state."""

    def _restore_linear_states(self, saved):
        for (i, s), (_conv, rec) in saved.items():
            self.cache.get_recurrent_state(i, s).copy_(rec)


class KeepsRecurrent(LiveTarget):
    """Mutation: restores the conv state but not the recurrent state."""

    def _restore_linear_states(self, saved):
        for (i, s), (conv, _rec) in saved.items():
            self.cache.get_conv_state(i, s).copy_(conv)


class NoReplay(LiveTarget):
    """Mutation: rolls back to before the block but never advances over the committed tokens."""

    def _replay_mixers(self, calls, n, size):
        pass


class NoCrop(LiveTarget):
    """Mutation: keeps the rejected keys/values in the attention layers."""

    def _crop_attention(self, dropped):
        pass


class KeepsCount(LiveTarget):
    """Mutation: rolls the states back but not the linear layers' own token count (transformers >= 5.25)."""

    def _rewind_counts(self, counts):
        pass


@pytest.mark.parametrize(
    "mutant, broken",
    [(KeepsConv, "conv"), (KeepsRecurrent, "recurrent"), (NoReplay, "recurrent"), (NoCrop, "kv_length")],
)
def test_the_rollback_check_catches_a_missing_piece(target, mutant, broken):
    errors = rollback_errors(target, mutant, 3)
    assert errors[broken] > 1e-2, errors
    assert errors["states"] > 1e-2, errors  # and the next verify sees it


def test_the_rollback_check_catches_a_count_left_forward(target):
    """Since transformers 5.25 the model takes positions and masks from the first layer's own count;
    a count never rewound stands B ahead after the replay (the block, then its n committed tokens
    again): what the verifier got wrong on 5.25 before it rewound the counts."""
    if not keeps_own_counts(target):
        pytest.skip("this transformers release keeps no token count in its linear-attention layers")
    errors = rollback_errors(target, KeepsCount, 3)
    assert errors["kv_length"] == B and errors["seq_length"] == B, errors


@pytest.mark.parametrize("mutant", [KeepsConv, KeepsRecurrent, NoReplay, NoCrop])
def test_the_greedy_check_catches_a_broken_rollback(target, cases, mutant):
    """The end-to-end comparison is not blind: each mutant derails on some shipped prompt."""
    derailed = [
        speculate(mutant(target, TAPS), p, partly_right(longer), 4, LIMIT, target.eos_ids)[0] != ref
        for p, ref, longer in cases
    ]
    assert any(derailed)


# -- bookkeeping -----------------------------------------------------------------------------


def test_length_and_misuse(target):
    live = LiveTarget(target, TAPS)
    with pytest.raises(RuntimeError, match="before prefill"):
        live.verify(torch.tensor([1, 2]))
    prompt = prompt_ids(target, 1)[0]
    token, states = live.prefill(torch.tensor(prompt))
    assert live.length == len(prompt) == states.shape[0]
    with pytest.raises(RuntimeError, match="without a verified block"):
        live.commit(1)
    posterior, states = live.verify(torch.tensor([token, 5, 6]))
    assert posterior.shape == (3,) and posterior.dtype == torch.long and states.shape == (3, len(TAPS), 128)
    with pytest.raises(RuntimeError, match="verify twice"):
        live.verify(torch.tensor([1]))
    for bad in (0, 4):
        with pytest.raises(ValueError, match=f"commit\\({bad}\\)"):
            live.commit(bad)
    live.commit(2)
    assert live.length == len(prompt) + 2 == live.cache.get_seq_length()
    with pytest.raises(ValueError, match="1-D"):
        live.verify(torch.tensor([[1, 2]]))
    with pytest.raises(ConfigError, match="taps"):
        LiveTarget(target, [target.num_layers])

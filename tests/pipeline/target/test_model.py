import pytest
import torch

from pipeline.target.model import _cut
from tests.targets import bf16_close, prompt_ids, reference_states


def test_capture_equals_output_of_layer_k_and_catches_off_by_one(target):
    seqs = [p + p[:9] for p in prompt_ids(target, 3)]  # different lengths: padding in play
    taps = [0, 2, 3, 6]
    got = target.capture(seqs, taps)  # [T, n_taps, H] bf16
    assert got.dtype == torch.bfloat16 and got.shape == (sum(map(len, seqs)), len(taps), target.hidden_size)
    start = 0
    for seq in seqs:
        hs = reference_states(target, seq)
        mine = got[start : start + len(seq)]
        start += len(seq)
        for j, k in enumerate(taps):
            assert bf16_close(mine[:, j], hs[k + 1][0]), f"tap {k} != hidden_states[{k + 1}]"
            assert not bf16_close(mine[:, j], hs[k][0]), f"tap {k} also matches hidden_states[{k}]: test is blind"


def test_last_layer_tap_is_before_the_final_norm(target):
    seq = prompt_ids(target, 1)[0]
    last = target.num_layers - 1
    got = target.capture([seq], [last])[:, 0]  # output of the last decoder layer
    hs = reference_states(target, seq)
    assert not bf16_close(got, hs[-1][0])  # hidden_states[-1] has the final norm applied
    normed = target.model.get_decoder().norm(got.float())
    assert torch.allclose(normed, hs[-1][0], rtol=2e-2, atol=2e-2)


def test_batching_and_padding_do_not_change_states(target):
    seqs = prompt_ids(target, 4)
    taps = [1, 3, 5]
    together = target.capture(seqs, taps)
    alone = torch.cat([target.capture([s], taps) for s in seqs])
    assert bf16_close(together, alone.float())


def test_generate_is_the_targets_greedy_generate(target):
    prompts = prompt_ids(target, 4)
    limits = [20, 5, 20, 12]
    batched = target.generate(prompts, limits)
    for p, limit, got in zip(prompts, limits, batched):
        with torch.inference_mode():
            out = target.model.generate(torch.tensor([p]), max_new_tokens=limit, do_sample=False)
        assert got == _cut(out[0, len(p) :].tolist(), target.eos_ids, limit)
        assert len(got) <= limit


def test_generate_reports_each_token_as_it_is_made(target):
    """on_token(k) for every decoding step, in order, while generate runs (extraction's progress
    inside a batch); the completions are those made without it."""
    prompts, calls = prompt_ids(target, 3), []
    got = target.generate(prompts, [12] * 3, on_token=calls.append)
    assert got == target.generate(prompts, [12] * 3)
    assert calls == list(range(1, max(map(len, got)) + 1))


def test_linear_attention_path_is_recorded_from_the_calls(target):
    target.probe()
    b = target.check_backends()
    assert b.linear_attention == "torch" and b.attention == "sdpa"
    calls = b.kernel_calls
    assert calls.get("torch_chunk_gated_delta_rule:torch", 0) > 0  # prefill
    assert calls.get("torch_recurrent_gated_delta_rule:torch", 0) > 0  # decode


def test_cut_keeps_the_eos():
    assert _cut([5, 6, 2, 7], [2], 10) == [5, 6, 2]
    assert _cut([5, 6, 2, 7], [2], 2) == [5, 6]
    assert _cut([5, 6], [2], 10) == [5, 6]


@pytest.mark.parametrize("bad", ["/nonexistent/model", "."])
def test_unreadable_target(bad):
    from pipeline.errors import TargetError
    from pipeline.target.loading import load

    with pytest.raises(TargetError, match="--target"):
        load(bad, "cpu", "fp32", "auto")


def test_capture_with_agreement_keeps_the_states_and_counts_like_hugging_face(target):
    seqs = [p + [17, 300, 42, 9] for p in prompt_ids(target, 3)]
    plens = [len(p) for p in prompt_ids(target, 3)]
    plain = target.capture(seqs, [1, 3])
    hidden, (matches, tokens) = target.capture(seqs, [1, 3], plens)
    assert torch.equal(hidden, plain) and tokens == 4 * 3
    expected = 0
    for s, p in zip(seqs, plens):
        with torch.inference_mode():
            logits = target.model(input_ids=torch.tensor([s])).logits[0]  # [T, V]
        expected += int((logits[p - 1 : -1].argmax(-1) == torch.tensor(s[p:])).sum())
    assert matches == expected
    greedy = target.generate(prompt_ids(target, 3), [6] * 3)
    _, (m, n) = target.capture([p + g for p, g in zip(prompt_ids(target, 3), greedy)], [1], plens)
    assert m == n == sum(map(len, greedy))  # its own greedy tokens agree with it (fp32)

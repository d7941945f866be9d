import pytest
import torch

from pipeline.target.model import cut
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
        assert got == cut(out[0, len(p) :].tolist(), target.eos_ids, limit)
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
    assert cut([5, 6, 2, 7], [2], 10) == [5, 6, 2]
    assert cut([5, 6, 2, 7], [2], 2) == [5, 6]
    assert cut([5, 6], [2], 10) == [5, 6]


@pytest.mark.parametrize("bad", ["/nonexistent/model", "."])
def test_unreadable_target(bad):
    from pipeline.errors import TargetError
    from pipeline.target.loading import load

    with pytest.raises(TargetError, match="--target"):
        load(bad, "cpu", "fp32", "auto")


def test_a_decoder_without_a_layer_list_is_refused_naming_it(tmp_path):
    """GPT-2's decoder keeps its blocks in `h`: one TargetError naming the target and its decoder, not an
    AttributeError from inside a forward."""
    import shutil

    from transformers import GPT2Config, GPT2LMHeadModel

    from pipeline import TINY_TARGET
    from pipeline.errors import TargetError
    from pipeline.target.loading import load

    GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=1000)).save_pretrained(tmp_path)
    for f in TINY_TARGET.glob("tokenizer*"):
        shutil.copy(f, tmp_path)
    target = load(str(tmp_path), "cpu", "fp32", "auto")
    with pytest.raises(TargetError, match=rf"^{tmp_path}: its decoder \(GPT2Model\) has no layer list `layers`"):
        target.layers


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


def masked_capture(target, seqs, taps):
    """The capture as it was before --capture-tokens: one forward, right-padded, with the attention mask."""
    from pipeline.target.taps import StopForward, tapping

    ids, mask = target._pad(seqs, left=False)
    grabbed = {}
    try:
        with torch.inference_mode(), tapping(target.layers, taps, grabbed.__setitem__, stop_after_last=True):
            target.model.get_decoder()(input_ids=ids, attention_mask=mask, use_cache=False)
    except StopForward:
        pass
    return torch.stack([grabbed[k] for k in taps], dim=2).to(torch.bfloat16)[mask.bool()]  # [T, n_taps, H]


def budget_seqs(target):
    seqs = [p + p[:9] for p in prompt_ids(target, 6)]
    return seqs + [sum(prompt_ids(target, 12), [])[:300]]  # a row longer than the small budgets


@pytest.mark.parametrize("budget", [None, 10**6, 400, 200, 100, 64, 48])
def test_capture_tokens_give_the_masked_capture_of_each_forward_bit_for_bit(target, budget):
    """Each forward's states equal those of the capture before the budget (padded, masked) over the
    same rows, bit for bit; rows longer than the budget are chunked through the cache, within one
    bf16 step of one forward in a few values."""
    from pipeline.target.capture_batches import capture_batches

    seqs, taps = budget_seqs(target), [0, 2, 3, 7]
    got = target.capture(seqs, taps, budget=budget)
    assert got.shape == (sum(map(len, seqs)), len(taps), target.hidden_size)
    starts = [sum(map(len, seqs[:i])) for i in range(len(seqs))]
    chunked = 0
    for batch in capture_batches([len(s) for s in seqs], budget):
        want = masked_capture(target, [seqs[i] for i in batch.rows], taps).split([len(seqs[i]) for i in batch.rows])
        for i, w in zip(batch.rows, want):
            mine = got[starts[i] : starts[i] + len(seqs[i])]
            if budget is not None and batch.width > budget:
                chunked += 1
                # fp32: 0-4 values in 10^4 one bf16 step off (chunks of 48: 37 of 153,600)
                assert bf16_close(mine, w.float()) and (mine != w).float().mean() <= 1e-3, f"row {i} chunked"
            else:
                assert torch.equal(mine, w), f"row {i} (budget {budget})"
    assert chunked == (budget is not None and budget < 300)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_chunks_through_the_cache_build_no_mask_and_keep_sdpas_states_bit_for_bit(dtype, monkeypatch):
    """The long row's chunks after the first reach attention with no mask (chunk_attention.py); the
    states equal, bit for bit, those of the same chunks under transformers' sdpa with the mask it
    builds [1, 1, chunk, cached + chunk], which the reference run is seen to build."""
    import contextlib

    from pipeline import TINY_TARGET
    from pipeline.target import loading
    from pipeline.target import model as model_module

    target = loading.load(str(TINY_TARGET), "cpu", dtype, "torch")
    seqs, taps, masks = budget_seqs(target), [0, 2, 3, 7], []

    def seen(_module, _args, kwargs):
        cache = kwargs["cache"]
        if cache is not None and cache.get_seq_length(_module.layer_idx) > 0:  # a chunk after the first
            masks.append(kwargs.get("attention_mask"))

    attentions = [layer.self_attn for layer in target.layers if hasattr(layer, "self_attn")]
    for a in attentions:
        a.register_forward_pre_hook(seen, with_kwargs=True)
    got = target.capture(seqs, taps, budget=100)
    assert masks and all(m is None for m in masks)
    assert target.model.config._attn_implementation == "sdpa"  # switched back after the chunks
    masks.clear()
    monkeypatch.setattr(model_module, "chunk_attention", lambda model: contextlib.nullcontext())
    want = target.capture(seqs, taps, budget=100)
    assert masks and all(m is not None and m.shape[-2] < m.shape[-1] for m in masks)
    assert torch.equal(got, want)


def test_a_budget_at_least_the_padded_batch_is_todays_capture(target):
    """No budget, or one the padded batch fits, is one masked forward of every row, longest first
    (the order capture_batches sends them in), bit for bit. In the prompts' own order the states
    agree within a bf16 step, not bit for bit on every CPU: on an AVX-512 bf16 AMD EPYC the first
    linear-attention layer's core (the PyTorch chunked delta rule, batched over rows and heads)
    gives the long row other low bits in another batch position, and 1 state of 187,776 ends one
    bf16 step off (which kernel, not traced)."""
    from pipeline.target.capture_batches import capture_batches

    seqs, taps = budget_seqs(target), [1, 3, 5]
    (batch,) = capture_batches([len(s) for s in seqs], None)
    rows = [seqs[i] for i in batch.rows]
    by_row = dict(zip(batch.rows, masked_capture(target, rows, taps).split(list(map(len, rows)))))
    want = torch.cat([by_row[i] for i in range(len(seqs))])  # [T, taps, H] bf16, in the prompts' order
    assert torch.equal(target.capture(seqs, taps), want)
    assert torch.equal(target.capture(seqs, taps, budget=len(seqs) * 300), want)
    assert bf16_close(want.float(), masked_capture(target, seqs, taps))


@pytest.mark.parametrize("budget", [None, 100, 64])
def test_agreement_counts_do_not_depend_on_the_budget(target, budget):
    prompts = prompt_ids(target, 4)
    greedy = target.generate(prompts, [6] * 4)
    seqs = [p + g for p, g in zip(prompts, greedy)] + [sum(prompt_ids(target, 12), [])[:150] + [17, 300, 42]]
    plens = [len(p) for p in prompts] + [150]
    hidden, (m, n) = target.capture(seqs, [1, 3], plens, budget=budget)
    assert n == sum(map(len, greedy)) + 3
    assert m >= sum(map(len, greedy))  # the greedy completions agree in full (fp32); the made-up tail may not
    _, (m1, n1) = target.capture(seqs, [1, 3], plens)
    assert (m, n) == (m1, n1)
    assert bf16_close(hidden, target.capture(seqs, [1, 3]).float())


@pytest.mark.parametrize("budget", [64, 100, 400])
def test_held_tap_memory_is_one_layer_of_the_budget(target, budget):
    """Bytes of tap outputs still alive on the target's device when each layer starts, the layer's own
    input left out: none (each tap is copied out in its hook and let go). Every forward computes at
    most `budget` positions, so the device holds at most one layer output of the budget."""
    import weakref

    seqs, taps = budget_seqs(target), [0, 2, 3, 6]
    alive, peak, sizes = [], [0], []

    def keep(_module, _inputs, output):
        alive.append(weakref.ref(output[0] if isinstance(output, tuple) else output))

    def count(_module, args, kwargs):
        x = args[0] if args else kwargs["hidden_states"]  # [b, w, H]
        sizes.append(x.shape[0] * x.shape[1])
        held = [r() for r in alive if r() is not None and r() is not x]
        peak[0] = max(peak[0], sum(t.numel() * t.element_size() for t in held))

    handles = [target.layers[k].register_forward_hook(keep) for k in taps]
    handles += [layer.register_forward_pre_hook(count, with_kwargs=True) for layer in target.layers]
    try:
        target.capture(seqs, taps, budget=budget)
    finally:
        for h in handles:
            h.remove()
    assert peak[0] == 0, f"{peak[0]} bytes of taps held on the device"
    assert sizes and max(sizes) <= budget


def test_capture_with_the_final_state_adds_hugging_faces_last_hidden_state(target):
    """The taps are bit for bit those of a capture without it; the final state is hidden_states[-1] (after
    the final norm) up to bf16 rounding, batched and chunked alike; the gain is the norm's (1 + w)."""
    seqs = budget_seqs(target)  # with a row of 300 tokens: chunked through the cache at budget 64
    for budget in (None, 64):
        plain = target.capture(seqs, [1, 3], budget=budget)
        hidden, final = target.capture(seqs, [1, 3], budget=budget, final_state=True)
        assert torch.equal(hidden, plain) and final.shape == (len(hidden), target.hidden_size)
        at = 0
        for s in seqs:
            assert bf16_close(final[at : at + len(s)], reference_states(target, s)[-1][0]), budget
            at += len(s)
    gain = target.final_norm_gain()
    assert torch.allclose(gain, 1 + target.model.get_decoder().norm.weight.float(), atol=1e-5)

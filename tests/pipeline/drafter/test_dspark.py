"""The dspark head: vLLM 0.32's Qwen3DSparkModel names and config fields, strict loading, sequential
greedy drafting with the transition bias, and the DSpark objective against a direct computation."""

import json

import pytest
import torch
import torch.nn.functional as F

from pipeline.drafter import checkpoint
from pipeline.drafter.blocks import IGNORE, before_slots
from pipeline.drafter.config import DrafterConfig
from pipeline.drafter.dspark import sequential_drafts
from pipeline.drafter.dspark_loss import CONFIDENCE_WEIGHT, TV_WEIGHT, dspark_loss
from pipeline.drafter.loss import slot_weights
from pipeline.errors import DrafterError
from tests.drafters import B, H, V, config, drafter

R = 4  # Markov rank


def dspark(seed: int = 0):
    m = drafter(config(head="dspark", markov_rank=R), seed)
    with torch.no_grad():  # a head that biases: markov_w2 starts at zero
        m.markov_head.markov_w2.weight.copy_(torch.randn(V, R, generator=torch.Generator().manual_seed(7)) * 3)
    return m


def test_checkpoint_is_vllms_dspark_layout_and_loads_strictly(tmp_path):
    m = dspark()
    checkpoint.save(tmp_path / "d", m.config, m.state_dict())
    hf = json.loads((tmp_path / "d" / "config.json").read_text())
    assert hf["architectures"] == ["Qwen3DSparkModel"]
    assert (hf["markov_rank"], hf["enable_confidence_head"], hf["confidence_head_with_markov"]) == (R, True, True)
    assert hf["sample_from_anchor"] is False and hf["dflash_config"]["mask_token_id"] == V - 1
    config_back, tensors, _ = checkpoint.load(tmp_path / "d")
    assert config_back == m.config
    assert tuple(tensors["markov_head.markov_w1.weight"].shape) == (V, R)
    assert tuple(tensors["markov_head.markov_w2.weight"].shape) == (V, R)
    assert tuple(tensors["confidence_head.proj.weight"].shape) == (1, H + R)
    assert tuple(tensors["confidence_head.proj.bias"].shape) == (1,)
    del tensors["confidence_head.proj.bias"]
    with pytest.raises(DrafterError, match="missing: confidence_head.proj.bias"):
        checkpoint.check_tensors(config_back, tensors, "x")


def test_the_default_config_json_is_unchanged():
    hf = config().to_hf()
    assert hf["architectures"] == ["DFlashDraftModel"]
    assert not {"head", "markov_rank", "enable_confidence_head", "sample_from_anchor"} & set(hf)
    assert DrafterConfig.from_hf(hf).head == "dflash"


@pytest.mark.parametrize(
    "edit, needle",
    [
        (lambda d: d.pop("markov_rank"), "markov_rank is None"),
        (lambda d: d.update(confidence_head_with_markov=False), "confidence_head_with_markov is False"),
        (lambda d: d.update(sample_from_anchor=True), "sample_from_anchor is True"),
    ],
)
def test_other_dspark_layouts_are_refused_in_one_line(edit, needle):
    hf = config(head="dspark", markov_rank=R).to_hf()
    edit(hf)
    with pytest.raises(DrafterError, match=needle):
        DrafterConfig.from_hf(hf)


def test_the_backbone_starts_as_the_dflash_drafters_and_the_head_as_no_bias():
    plain, head = drafter(config()), drafter(config(head="dspark", markov_rank=R))
    for name, p in plain.state_dict().items():
        assert torch.equal(p, head.state_dict()[name]), name
    h = torch.randn(3, B - 1, H)
    assert torch.equal(head.chain_drafts(h, torch.tensor([1, 2, 3])), plain.chain_drafts(h, torch.tensor([1, 2, 3])))


def test_chain_drafts_take_each_slots_previous_draft():
    m, g = dspark(), torch.Generator().manual_seed(3)  # seeded: the last line's claim is about these inputs
    h, first = torch.randn(5, B - 1, H, generator=g), torch.randint(0, V, (5,), generator=g)
    base = m.logits(h)
    w1, w2 = m.markov_head.markov_w1.weight, m.markov_head.markov_w2.weight
    for n in range(5):
        prev, want = int(first[n]), []
        for k in range(B - 1):
            prev = int((base[n, k] + w2 @ w1[prev]).argmax())
            want.append(prev)
        assert m.chain_drafts(h, first)[n].tolist() == want
    assert not torch.equal(m.chain_drafts(h, first), base.argmax(-1))  # the bias changes drafts here


def test_a_transition_the_head_makes_certain_is_drafted_in_turn():
    m = drafter(config(head="dspark", markov_rank=V))
    with torch.no_grad():  # token t is followed by t + 1: w2 @ w1[t] = 100 one_hot(t + 1)
        m.markov_head.markov_w1.weight.copy_(torch.eye(V))
        m.markov_head.markov_w2.weight.copy_(torch.roll(torch.eye(V), 1, 0) * 100)
    drafts = sequential_drafts(m.logits(torch.randn(2, B - 1, H)), torch.tensor([3, 10]), m.markov_head)
    assert drafts.tolist() == [[4, 5, 6], [11, 12, 13]]


def test_the_token_before_each_slot_is_the_anchor_then_the_targets_tokens():
    tokens = torch.arange(100, 110)[None]
    prev = before_slots(tokens, torch.tensor([[2, 8]]), B)
    assert prev[0, 0, 1:].tolist() == [102, 103, 104]
    assert prev[0, 1, 1:].tolist() == [108, 109, 109]  # past the end: clamped, and never labelled


def _direct(m, h, labels, prev, gamma, target=None):
    """The objective from full logits, slot by slot (target: the final states before the slots, soft TV)."""
    keep = labels != IGNORE
    w = slot_weights(B, gamma).expand(labels.shape)[keep]
    hs = h.reshape(*labels.shape, -1)[keep]
    e = m.markov_head.markov_w1.weight[prev[keep]]
    z = hs @ m.lm_head.T + e @ m.markov_head.markov_w2.weight.T
    p = torch.softmax(z, -1).gather(1, labels[keep][:, None]).squeeze(1)
    tv = 1 - p
    if target is not None:
        tv = 0.5 * (torch.softmax(target[keep] @ m.lm_head.T, -1) - torch.softmax(z, -1)).abs().sum(-1)
    mix = TV_WEIGHT * tv + (1 - TV_WEIGHT) * -torch.log(p)
    hit = (z.argmax(-1) == labels[keep]).float()
    conf = torch.cat([hs, e], -1) @ m.confidence_head.proj.weight[0] + m.confidence_head.proj.bias
    return (w * mix).sum() / w.sum() + CONFIDENCE_WEIGHT * F.binary_cross_entropy_with_logits(conf, hit)


def inputs(seed: int):
    """(its generator, drafter states [2, 3B, H], labels [2, 3, B] without slot 0's, prev [2, 3, B])."""
    g = torch.Generator().manual_seed(seed)
    h = torch.randn(2, 3 * B, H, generator=g, requires_grad=True)
    labels = torch.randint(0, V, (2, 3, B), generator=g)
    labels[..., 0] = IGNORE
    return g, h, labels, torch.randint(0, V, (2, 3, B), generator=g)


@pytest.mark.parametrize("rows", [1, 3, 4096])
def test_the_loss_is_the_tv_ce_mix_and_the_confidence_bce(rows):
    m = dspark().float()
    _, h, labels, prev = inputs(2)
    labels[1, 2, 2:] = IGNORE
    out = dspark_loss(h, labels, prev, m.lm_head, m.markov_head, m.confidence_head, 2.0, chunk_rows=rows)
    torch.testing.assert_close(out.loss, _direct(m, h, labels, prev, 2.0), rtol=1e-5, atol=1e-6)
    out.loss.backward()
    assert h.grad.abs().sum() > 0
    assert m.markov_head.markov_w1.weight.grad.abs().sum() > 0
    assert m.markov_head.markov_w2.weight.grad.abs().sum() > 0
    assert m.confidence_head.proj.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("rows", [1, 4096])
def test_soft_targets_put_the_tv_toward_the_targets_distribution(rows):
    m = dspark().float()
    g, h, labels, prev = inputs(3)
    target = torch.randn(2, 3, B, H, generator=g)
    heads = (m.lm_head, m.markov_head, m.confidence_head)
    out = dspark_loss(h, labels, prev, *heads, 2.0, chunk_rows=rows, target=target)
    torch.testing.assert_close(out.loss, _direct(m, h, labels, prev, 2.0, target), rtol=1e-5, atol=1e-6)
    hard = dspark_loss(h, labels, prev, *heads, 2.0, chunk_rows=rows)
    assert torch.equal(out.sums, hard.sums) and not torch.isclose(out.loss, hard.loss)


def test_the_confidence_head_moves_nothing_else():
    m = dspark().float()
    h = torch.randn(1, B, H, requires_grad=True)
    labels = torch.tensor([[[IGNORE, 1, 2, 3]]])
    prev = torch.tensor([[[0, 5, 1, 2]]])
    conf = m.confidence_head
    out = dspark_loss(h, labels, prev, m.lm_head, m.markov_head, conf, 2.0)
    g_all = torch.autograd.grad(out.loss, h, retain_graph=True)[0]
    m.confidence_head.proj.weight.data.mul_(5)  # a different probe: the same gradient into h
    out2 = dspark_loss(h, labels, prev, m.lm_head, m.markov_head, conf, 2.0)
    torch.testing.assert_close(torch.autograd.grad(out2.loss, h)[0], g_all)

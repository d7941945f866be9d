"""The DFlash loss and its metrics on hand-made cases; the fused linear + cross-entropy against a plain
reference (full logits, F.cross_entropy) at the tiny target's sizes; D-PACE slot weights; the
expected-acceptance term (a one-hot drafter's is its streak; loss and gradient against the definition)."""

import math

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from pipeline.drafter import loss as L
from pipeline.drafter.blocks import IGNORE
from pipeline.drafter.loss import dflash_loss, slot_weights, streaks, summarize

V = 5
HEAD = torch.eye(V)  # lm_head = identity: the drafter output IS the logits


def logits_for(label: int, confident: bool) -> list[float]:
    return [10.0 if (i == label and confident) else 0.0 for i in range(V)]


def test_slot_weights():
    w = slot_weights(16, 7.0)
    assert w[0] == 0 and w[1] == 1 and math.isclose(float(w[2]), math.exp(-1 / 7), rel_tol=1e-6)
    assert math.isclose(float(w[15]), math.exp(-14 / 7), rel_tol=1e-6)


def test_weighted_ce_by_hand():
    # one block of 3 slots: slot 1 uniform over V (CE = ln V), slot 2 confident and right (CE ~ 0)
    h = torch.tensor([[logits_for(0, True), [0.0] * V, logits_for(3, True)]])
    labels = torch.tensor([[[IGNORE, 1, 3]]])
    out = dflash_loss(h, labels, HEAD, gamma=2.0)
    w1, w2 = 1.0, math.exp(-1 / 2)
    ce2 = math.log(1 + (V - 1) * math.exp(-10))
    assert math.isclose(float(out.loss), (w1 * math.log(V) + w2 * ce2) / (w1 + w2), rel_tol=1e-5)


def test_slot0_never_counts():
    h = torch.tensor([[[0.0, 0, 0, 0, 50], logits_for(2, True)]])
    with_label = dflash_loss(h, torch.tensor([[[0, 2]]]), HEAD, gamma=7.0).loss  # a (wrong) label at slot 0
    without = dflash_loss(h, torch.tensor([[[IGNORE, 2]]]), HEAD, gamma=7.0).loss
    assert torch.equal(with_label, without)


def test_ignored_labels_change_nothing():
    g = torch.Generator().manual_seed(0)
    h = torch.randn(1, 8, V, generator=g)
    a = torch.tensor([[[IGNORE, 1, 2, 3], [IGNORE, 4, IGNORE, IGNORE]]])
    b = torch.tensor([[[IGNORE, 1, 2, 3], [IGNORE, 4, IGNORE, IGNORE]]])
    h2 = h.clone()
    h2[0, 6:] = 99.0  # outputs at ignored slots are irrelevant
    assert torch.equal(dflash_loss(h, a, HEAD, 7.0).loss, dflash_loss(h2, b, HEAD, 7.0).loss)


def test_chunked_equals_whole_including_gradients():
    g = torch.Generator().manual_seed(1)
    labels = torch.randint(0, V, (2, 3, 4), generator=g)
    labels[..., 0] = IGNORE
    labels[1, 2, 2:] = IGNORE
    grads = []
    for chunk in (1, 5, 4096):
        h = torch.randn(2, 12, V, generator=torch.Generator().manual_seed(2), requires_grad=True)
        out = dflash_loss(h, labels, HEAD, 7.0, chunk_rows=chunk)
        out.loss.backward()
        grads.append((out.loss.detach(), h.grad))
    for loss, grad in grads[1:]:
        assert torch.allclose(loss, grads[0][0]) and torch.allclose(grad, grads[0][1])


def test_streaks_and_tau():
    correct = torch.tensor([[[False, True, True, False, True], [True, False, True, True, True]]])
    keep = torch.ones_like(correct)
    keep[0, 1, 0] = False
    assert streaks(correct, keep).tolist() == [[2, 0]]
    keep2 = keep.clone()
    keep2[0, 0, 2:] = False  # labels end after slot 1: the streak stops there
    assert streaks(correct, keep2).tolist() == [[1, 0]]


def test_summary_of_a_perfect_and_a_hopeless_block():
    h = torch.tensor(
        [
            [
                logits_for(0, True),
                logits_for(1, True),
                logits_for(2, True),
                logits_for(0, True),
                logits_for(4, True),
                logits_for(4, True),
            ]
        ]
    )
    labels = torch.tensor([[[IGNORE, 1, 2], [IGNORE, 3, 4]]])
    m = summarize(dflash_loss(h, labels, HEAD, 7.0).sums)
    assert m["tau_streak"] == pytest.approx((3 + 1) / 2)  # block 0: 2 drafts + bonus; block 1: bonus only
    assert m["acc"] == [0.5, 1.0] and m["blocks"] == 2 and m["labels"] == 4


# --- the fused linear + cross-entropy against a plain reference -----------------------------------------------
TINY_H, TINY_V = 128, 4096  # the shipped tiny target's hidden size and vocabulary
RTOL, ATOL = 1e-5, 1e-6  # fp32: only summation order differs from the reference


def tiny_case(seed=0, b=2, n=5, B=16):
    g = torch.Generator().manual_seed(seed)
    head = torch.randn(TINY_V, TINY_H, generator=g) * 0.2
    h = torch.randn(b, n * B, TINY_H, generator=g)
    labels = torch.randint(0, TINY_V, (b, n, B), generator=g)
    labels[..., 0] = IGNORE
    labels[torch.rand(b, n, B, generator=g) < 0.2] = IGNORE  # holes, including mid-block ones
    labels[-1, -1] = IGNORE  # a padded block
    return h, labels, head


def reference_dpace(ce, keep, alpha):
    """D-PACE weights by the definition, one block at a time with Python loops."""
    w = torch.zeros_like(ce)
    for idx in torch.cartesian_prod(*(torch.arange(s) for s in ce.shape[:-1])).reshape(-1, ce.dim() - 1).tolist():
        c, k = ce[tuple(idx)].tolist(), keep[tuple(idx)].tolist()
        reach, prod = [], 1.0
        for ck, kk in zip(c, k):
            prod *= alpha + (1 - alpha) * math.exp(-ck) if kk else 1.0
            reach.append(prod if kk else 0.0)
        w[tuple(idx)] = torch.tensor([sum(reach[j:]) if k[j] else 0.0 for j in range(len(c))])
    return w


def reference_loss(h, labels, head, gamma=None, alpha=None):
    """Full logits, F.cross_entropy, fixed weights."""
    b, n, B = labels.shape
    keep = labels != IGNORE
    logits = F.linear(h.reshape(b, n, B, -1), head).float()  # [b, N, B, V]
    ce = torch.zeros(b, n, B)
    ce[keep] = F.cross_entropy(logits[keep], labels[keep], reduction="none")
    if alpha is None:
        w = slot_weights(B, gamma).expand(b, n, B) * keep
    else:
        w = reference_dpace(ce.detach(), keep, alpha)
    return (w * ce).sum() / w.sum(), logits.argmax(-1)


@pytest.mark.parametrize("weights", [dict(gamma=7.0), dict(gamma=None, dpace=0.5), dict(gamma=None, dpace=0.3)])
@pytest.mark.parametrize("rows", [None, 1, 7, 64, 10_000])  # 7 and 64 cut the ~130 rows unevenly
def test_fused_loss_and_gradient_equal_the_reference(weights, rows):
    h, labels, head = tiny_case()
    h1, h2 = h.clone().requires_grad_(), h.clone().requires_grad_()
    out = dflash_loss(h1, labels, head, weights["gamma"], dpace=weights.get("dpace"), chunk_rows=rows)
    out.loss.backward()
    ref, ref_pred = reference_loss(h2, labels, head, weights["gamma"], weights.get("dpace"))
    ref.backward()
    keep = labels != IGNORE
    assert torch.allclose(out.loss, ref, rtol=RTOL, atol=ATOL)
    assert torch.allclose(h1.grad, h2.grad, rtol=RTOL, atol=ATOL) and h1.grad.abs().sum() > 0
    assert out.sums[5 + 16 :].sum() == keep.sum()  # every label counted once
    correct = ((ref_pred == labels) & keep).flatten(0, 1).sum(0).float()
    assert torch.equal(out.sums[5 : 5 + 16], correct)


def test_linear_cross_entropy_rows_match_f_cross_entropy():
    h, labels, head = tiny_case(seed=3)
    x, y = h.reshape(-1, TINY_H)[:100], labels.flatten()[:100].clamp(min=0)
    for rows in (1, 13, 100):
        ce, pred = L.linear_cross_entropy(x, head, y, rows)
        logits = x @ head.T
        assert torch.allclose(ce, F.cross_entropy(logits, y, reduction="none"), rtol=RTOL, atol=ATOL)
        assert torch.equal(pred, logits.argmax(-1))


def test_empty_labels():
    h = torch.randn(1, 32, TINY_H, requires_grad=True)
    labels = torch.full((1, 2, 16), IGNORE)
    for dpace in (None, 0.5):
        out = dflash_loss(h, labels, torch.randn(TINY_V, TINY_H), 7.0, dpace=dpace)
        out.loss.backward()
        assert out.loss.item() == 0 and torch.equal(h.grad, torch.zeros_like(h)) and not out.sums.any()
        h.grad = None


def test_frozen_head_is_required():
    with pytest.raises(ValueError, match="frozen"):
        L.linear_cross_entropy(torch.randn(3, 4), torch.randn(5, 4, requires_grad=True), torch.tensor([0, 1, 2]))


class LargestTensor(TorchDispatchMode):
    """The most elements of any floating tensor an op makes (views of existing tensors, such as
    lm_head.T, are not new memory and are not counted)."""

    def __init__(self):
        super().__init__()
        self.most = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view:
            return out
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.is_floating_point():
                self.most = max(self.most, t.numel())
        return out


def test_logits_never_exceed_the_budget():
    budget = 16 * TINY_V * 4  # 16 rows of fp32 logits
    rows = L.rows_within(TINY_V, budget)
    assert rows == 16
    h, labels, head = tiny_case(seed=1, b=1, n=24)  # ~300 labelled rows: [300, V] would be 19x the budget
    h.requires_grad_()
    with LargestTensor() as fused:
        dflash_loss(h, labels, head, 7.0, chunk_rows=rows).loss.backward()
    with LargestTensor() as plain:
        reference_loss(h, labels, head, 7.0)[0].backward()
    assert fused.most <= rows * TINY_V  # bounded ...
    assert plain.most >= (labels != IGNORE).sum() * TINY_V  # ... where the plain loss holds all logits


def test_default_chunk_fits_the_byte_budget_at_any_vocabulary():
    for v in (50, 4096, 151_936, 248_320, 10**9):
        rows = L.rows_within(v)
        assert rows >= 1 and (rows * v * 4 <= L.LOGITS_BYTES or rows == 1)
    assert L.rows_within(248_320) == 270  # Qwen3.6-27B: 270 rows, 256 MiB of fp32 logits


@pytest.mark.parametrize("h_dtype", [torch.float32, torch.bfloat16])
def test_under_bf16_autocast(h_dtype):
    """As on GPU: autocast on, bf16 lm_head; the gradient comes back in h's dtype and matches a
    reference that makes the same bf16 logits."""
    h, labels, head = tiny_case(seed=2)
    head = head.bfloat16()
    h1 = h.to(h_dtype).requires_grad_()
    h2 = h.to(h_dtype).requires_grad_()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = dflash_loss(h1, labels, head, 7.0, chunk_rows=7)
        out.loss.backward()
    ref, _ = reference_loss(h2.to(torch.bfloat16), labels, head, 7.0)
    ref.backward()
    assert h1.grad.dtype == h_dtype
    assert torch.allclose(out.loss, ref, rtol=1e-4)
    assert torch.allclose(h1.grad.float(), h2.grad.float(), rtol=0.02, atol=1e-4)  # bf16 rounding of the product


# --- D-PACE slot weights ------------------------------------------------------------------------------------
def test_dpace_weights_by_hand():
    a = 0.5
    ce = torch.tensor([[[0.0, -math.log(0.8), 0.0, -math.log(0.2)]]])  # slot confidences 0.8, 1.0, 0.2
    keep = torch.tensor([[[False, True, True, True]]])
    s = [a + (1 - a) * q for q in (0.8, 1.0, 0.2)]  # 0.9, 1.0, 0.6
    c = [s[0], s[0] * s[1], s[0] * s[1] * s[2]]
    want = [0.0, c[0] + c[1] + c[2], c[1] + c[2], c[2]]
    assert torch.allclose(L.dpace_weights(ce, keep, a)[0, 0], torch.tensor(want))


def test_dpace_holes_and_alpha_one():
    ce = torch.rand(2, 3, 6)
    keep = torch.ones(2, 3, 6, dtype=torch.bool)
    keep[..., 0] = False
    keep[0, 1, 3] = False  # a mid-block hole: factor 1 in the product, no weight of its own
    w = L.dpace_weights(ce, keep, 0.4)
    assert torch.allclose(w, reference_dpace(ce, keep, 0.4)) and w[0, 1, 3] == 0 and (w[..., 0] == 0).all()
    both = keep[..., 1:-1] & keep[..., 2:]
    assert (w[keep] > 0).all() and (w[..., 1:-1][both] > w[..., 2:][both]).all()  # decreasing along the block
    flat = L.dpace_weights(ce, keep, 1.0)  # alpha = 1: the labelled slots at or after k
    assert flat[1, 0].tolist() == [0, 5, 4, 3, 2, 1] and flat[0, 1].tolist() == [0, 4, 3, 0, 2, 1]


def test_dpace_weights_follow_the_confidence_and_carry_no_gradient():
    """A confident first draft raises the weight of the later slots; the weights are not differentiated."""
    keep = torch.tensor([[[False, True, True]]])
    sure, unsure = torch.tensor([[[0.0, 0.01, 1.0]]]), torch.tensor([[[0.0, 5.0, 1.0]]])
    assert L.dpace_weights(sure, keep, 0.5)[0, 0, 2] > L.dpace_weights(unsure, keep, 0.5)[0, 0, 2]
    ce = sure.clone().requires_grad_()
    assert not L.dpace_weights(ce, keep, 0.5).requires_grad


# --- expected acceptance ------------------------------------------------------------------------------------
def reference_acceptance(h, labels, head):
    """1 - E/K per counted block, averaged, by the definition with full logits and Python loops."""
    b, n, B = labels.shape
    logp = F.log_softmax(F.linear(h.reshape(b, n, B, -1), head).float(), -1)  # [b, N, B, V]
    total, blocks = 0.0, 0
    for i in range(b):
        for j in range(n):
            if labels[i, j, 1] == IGNORE:
                continue
            blocks += 1
            reach, e = 1.0, 0.0
            for k in range(1, B):
                if labels[i, j, k] == IGNORE:
                    break
                reach = reach * logp[i, j, k, labels[i, j, k]].exp()  # A_k
                e = e + reach
            total = total + 1 - e / (B - 1)
    return total / max(blocks, 1)


def one_hot_case(seed, b=3, n=6, B=8, v=8):
    """Drafter outputs whose logits are 50 on one token (its probability is 1.0 in fp32), labels equal
    to those tokens or not, with blocks cut short (sequence ended) and mid-block holes."""
    g = torch.Generator().manual_seed(seed)
    pred = torch.randint(0, v, (b, n, B), generator=g)
    miss = torch.rand(b, n, B, generator=g) < 0.25
    labels = torch.where(miss, (pred + 1 + torch.randint(0, v - 1, (b, n, B), generator=g)) % v, pred)
    labels[..., 0] = IGNORE
    ends = torch.randint(1, B + 1, (b, n), generator=g)  # labels stop at slot `end`
    labels[torch.arange(B) >= ends[..., None]] = IGNORE
    labels[torch.rand(b, n, B, generator=g) < 0.05] = IGNORE
    h = 50.0 * F.one_hot(pred, v).float().reshape(b, n * B, v)
    return h, labels, torch.eye(v), pred


@pytest.mark.parametrize("seed", range(4))
def test_expected_acceptance_of_a_one_hot_drafter_is_its_streak(seed):
    h, labels, head, pred = one_hot_case(seed)
    keep = labels != IGNORE
    ce, _ = L.linear_cross_entropy(h.reshape(*labels.shape, -1)[keep], head, labels[keep])
    e = L.expected_accepted(ce, keep)  # [b, N]
    streak = streaks(pred == labels, keep)
    assert streak.max() >= 3 and (streak == 0).any()  # long streaks and immediate misses both present
    assert torch.allclose(e, streak.float(), atol=1e-5)
    blocks = keep[..., 1]
    loss = dflash_loss(h, labels, head, 7.0, acceptance=1.0).loss
    assert math.isclose(float(loss), float((1 - streak[blocks] / 7).mean()), abs_tol=1e-6)


def test_a_hand_made_one_hot_block():
    # slots 1..4: right, right, wrong, right; slot 5 right; then the sequence ends: E = 2
    pred = [0, 1, 2, 3, 4, 0, 1, 2]
    labels = torch.tensor([[[IGNORE, 1, 2, 0, 4, 0, IGNORE, IGNORE]]])
    h = torch.tensor([[[50.0 if t == p else 0.0 for t in range(V)] for p in pred]])
    keep = labels != IGNORE
    ce, _ = L.linear_cross_entropy(h[0][keep[0, 0]], HEAD, labels[keep])
    assert torch.allclose(L.expected_accepted(ce, keep), torch.tensor([[2.0]]), atol=1e-6)
    labels[0, 0, 3] = 3  # now right: 5 leading drafts, then no label
    ce, _ = L.linear_cross_entropy(h[0][keep[0, 0]], HEAD, labels[keep])
    assert torch.allclose(L.expected_accepted(ce, keep), torch.tensor([[5.0]]), atol=1e-6)


@pytest.mark.parametrize("lam", [0.25, 0.5, 1.0])
@pytest.mark.parametrize("rows", [None, 7])
def test_acceptance_loss_and_gradient_equal_the_reference(lam, rows):
    h, labels, head = tiny_case(seed=4)
    h = h * 0.05  # soft: probabilities well inside (0, 1), so every A_j moves
    h1, h2 = h.clone().requires_grad_(), h.clone().requires_grad_()
    dflash_loss(h1, labels, head, 7.0, chunk_rows=rows, acceptance=lam).loss.backward()
    ce_only, _ = reference_loss(h2, labels, head, 7.0)
    (lam * reference_acceptance(h2, labels, head) + (1 - lam) * ce_only).backward()
    assert torch.allclose(h1.grad, h2.grad, rtol=1e-4, atol=1e-7) and h1.grad.abs().sum() > 0


def test_acceptance_gradient_reaches_every_slot_up_to_the_first_unlabelled_one():
    g = torch.Generator().manual_seed(5)
    B, head = 8, torch.randn(TINY_V, TINY_H, generator=g) * 0.2
    h = (torch.randn(1, 3 * B, TINY_H, generator=g) * 0.05).requires_grad_()
    labels = torch.randint(0, TINY_V, (1, 3, B), generator=g)
    labels[..., 0] = IGNORE
    labels[0, 1, 5:] = IGNORE  # the sequence ends after slot 4
    labels[0, 2, 3] = IGNORE  # a hole: acceptance stops at slot 2; slots 4.. have labels but are never reached
    dflash_loss(h, labels, head, 7.0, acceptance=1.0).loss.backward()
    moved = h.grad.reshape(3, B, -1).abs().sum(-1) > 0  # [N, B]
    reached = torch.zeros(3, B, dtype=torch.bool)
    reached[0, 1:], reached[1, 1:5], reached[2, 1:3] = True, True, True
    assert torch.equal(moved, reached)


def test_acceptance_weight_zero_is_the_cross_entropy_exactly():
    h, labels, head = tiny_case(seed=6)
    outs = {}
    for lam in (None, 0.0, 0.5, 1.0):
        x = h.clone().requires_grad_()
        out = dflash_loss(
            x, labels, head, None, dpace=0.5, chunk_rows=7, **({} if lam is None else {"acceptance": lam})
        )
        out.loss.backward()
        outs[lam] = (out.loss.detach(), x.grad, out.sums)
    assert torch.equal(outs[None][0], outs[0.0][0]) and torch.equal(outs[None][1], outs[0.0][1])
    keep = labels != IGNORE
    ce, _ = L.linear_cross_entropy(h.reshape(*labels.shape, -1)[keep], head, labels[keep], 7)
    acc = L.acceptance_loss(ce, keep)
    assert torch.equal(outs[1.0][0], acc)
    assert torch.allclose(outs[0.5][0], 0.5 * acc + 0.5 * outs[0.0][0])
    assert 0 < float(acc) < 1 and not torch.allclose(outs[1.0][0], outs[0.0][0])
    assert all(torch.equal(outs[lam][2], outs[None][2]) for lam in outs)  # the metrics are the weighted CE's


def test_acceptance_with_no_counted_block():
    h = torch.randn(1, 32, TINY_H, requires_grad=True)
    labels = torch.full((1, 2, 16), IGNORE)
    labels[0, 0, 0] = 3  # slot 0 only: no draft has a label, no block counts
    out = dflash_loss(h, labels, torch.randn(TINY_V, TINY_H), 7.0, acceptance=1.0)
    out.loss.backward()
    assert out.loss.item() == 0 and not h.grad.any()

"""The DFlash loss and its metrics (SPEC §2, Training).

loss = sum over labelled slots of w_k * CE_k / sum of their w_k (norm "weights", SPEC), or / their
number (norm "labels", as speculators normalises); slot 0 (the anchor's own token) never has a
label. Hard labels, and with --soft-targets the target's distribution too (soft_targets.py). Two slot
weightings:

- exp (SPEC §2, the default): w_k = exp(-(k-1)/gamma) for k >= 1.
- dpace (D-PACE, arXiv:2605.18810): per block, each labelled slot's confidence q_k = exp(-CE_k) is
  smoothed to s_k = alpha + (1-alpha) q_k, C_k = s_1 ... s_k is the chance the drafts up to k all
  land, and w_k = C_k + C_{k+1} + ... (the expected accepted length still riding on slot k). The
  weights are data, not part of the graph: no gradient flows through them. Unlabelled slots are
  a factor 1 in C and add nothing to the sums.

Expected acceptance (mixed in with weight `acceptance`, default 0: cross-entropy only). With hard
labels, slot i's acceptance chance is the drafter's probability of the target's token there,
alpha_i = exp(-CE_i) (it equals 1 - TV_i between the drafter's distribution and the one-hot target, so
the TV/L1 form and the product form coincide here). A_j = alpha_1 ... alpha_j = exp(-(CE_1 + ... +
CE_j)) is the chance drafts 1..j are all accepted, E = A_1 + ... + A_K (K = B-1) the expected number of
accepted drafts, and L_acc = 1 - E/K per block, averaged over the blocks that count (slot 1 labelled,
as the metrics count them). A slot without a label stops acceptance: A_j = 0 from there on, and no
gradient flows from it. The product weights the slots itself (a miss at slot 1 costs every later
A_j), so the exp/D-PACE slot weights apply to the CE part only:
loss = acceptance * L_acc + (1 - acceptance) * CE_loss.

Not here: a top-k term for trees. DDTree acceptance depends on the rank of the target's token at each
depth (a tree with k branches a depth accepts when the token is among its top k), so its term would
put the drafter's top-k mass of the target's token, P(rank < k), in place of alpha_i; that is not
differentiable as it stands (a rank), and no smooth surrogate was measured.

Logits are made only for labelled slots, by a fused linear + cross-entropy that holds one bounded
slice of logits at a time (LOGITS_BYTES) in the forward and again in the backward, so a 248k
vocabulary never holds [rows, V] for the whole batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pipeline.drafter.blocks import IGNORE
from pipeline.drafter.soft_targets import rejection_log, slot_terms

LOGITS_BYTES = 256 * 2**20  # fp32 logits of one chunk; with a bf16 lm_head the chunk's peak is about 1.5x this
# The fused loss's chunk on a GPU (arithmetic). Each chunk of r rows reads the whole lm_head [V, H]
# (bf16: 2VH bytes) for 2rVH FLOP, and moves about 6rV bytes of logits (bf16 out, fp32 copy): about
# rH / (H + 3r) FLOP a byte. An H100 SXM's bf16 ridge point is 989 TFLOP/s / 3.35 TB/s = 295 FLOP/B
# (an H200's 206). At V = 248,320 and H = 5120, 256 MiB of fp32 logits (LOGITS_BYTES) is r = 270:
# 233 FLOP/B, below the H100's ridge, memory-bound; 1 GiB is r = 1,081: 662 FLOP/B, 2.2x the ridge,
# compute-bound, for a chunk peak of about 1.5 GiB (0.02 of an 80 GB GPU).
GPU_LOGITS_BYTES = 2**30


def slot_weights(block_size: int, gamma: float) -> torch.Tensor:
    """[B] fp32: 0 for slot 0, exp(-(k-1)/gamma) for slot k >= 1."""
    k = torch.arange(block_size, dtype=torch.float32)
    w = torch.exp(-(k - 1) / gamma)
    w[0] = 0.0
    return w


def dpace_weights(ce: torch.Tensor, keep: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE slot weights (see the module doc), detached.

    ce: [b, N, B] fp32 per-slot CE (any value where not kept); keep: [b, N, B] bool -> [b, N, B] fp32,
    0 where not kept."""
    q = torch.exp(-ce.detach().float())
    smooth = torch.where(keep, alpha + (1 - alpha) * q, torch.ones_like(q))
    reach = torch.cumprod(smooth, -1) * keep  # C_k: [b, N, B]
    return reach.flip(-1).cumsum(-1).flip(-1) * keep


def rows_within(vocab: int, budget: int = LOGITS_BYTES) -> int:
    """Rows of fp32 logits that fit the budget (at least one)."""
    return max(1, budget // (vocab * 4))


def _logits(h: torch.Tensor, head: torch.Tensor) -> torch.Tensor:
    """h: [r, H] -> [r, V] fp32, the matmul in head's dtype (as the drafter's own head does it)."""
    return F.linear(h.to(head.dtype), head).float()


class LinearCrossEntropy(torch.autograd.Function):
    """Per-row CE and argmax of logits = h @ head.T, never holding more than `rows` rows of logits.

    Saves h, labels and per-row logsumexp; the backward recomputes each chunk's logits. head is
    frozen: it gets no gradient. Runs with autocast off; the casts are explicit (h to head's dtype
    for the matmul, fp32 for the softmax, the gradient back to h's dtype)."""

    @staticmethod
    def forward(ctx, h, head, labels, rows: int):
        # h: [M, H]; head: [V, H] frozen; labels: [M] long in [0, V)
        ce = h.new_empty(len(labels), dtype=torch.float32)
        lse = torch.empty_like(ce)
        pred = torch.empty_like(labels)
        with torch.autocast(h.device.type, enabled=False):
            for lo in range(0, len(labels), rows):
                sl = slice(lo, lo + rows)
                z = _logits(h[sl], head)  # [rows, V] fp32
                pred[sl] = z.argmax(-1)
                picked = z.gather(1, labels[sl, None]).squeeze(1)
                top = z.amax(-1)
                lse[sl] = top + z.sub_(top[:, None]).exp_().sum(-1).log()  # z reused in place
                ce[sl] = lse[sl] - picked
        ctx.save_for_backward(h, head, labels, lse)
        ctx.rows = rows
        ctx.mark_non_differentiable(pred)
        return ce, pred

    @staticmethod
    def backward(ctx, grad_ce, grad_pred):
        h, head, labels, lse = ctx.saved_tensors
        grad_h = torch.zeros_like(h)
        if grad_ce is None:
            return grad_h, None, None, None
        with torch.autocast(h.device.type, enabled=False):
            for lo in range(0, len(labels), ctx.rows):
                sl = slice(lo, lo + ctx.rows)
                p = _logits(h[sl], head)  # [rows, V] fp32, made the softmax in place
                p.sub_(lse[sl, None]).exp_()
                p[torch.arange(len(p), device=p.device), labels[sl]] -= 1.0
                p.mul_(grad_ce[sl, None].float())
                grad_h[sl] = (p.to(head.dtype) @ head).to(h.dtype)  # [rows, H]
        return grad_h, None, None, None


def linear_cross_entropy(h: torch.Tensor, head: torch.Tensor, labels: torch.Tensor, rows: int | None = None):
    """h: [M, H]; head: [V, H] frozen; labels: [M] -> (ce [M] fp32, differentiable in h; pred [M] long).
    rows: logits rows per chunk (default: what LOGITS_BYTES allows at this vocabulary)."""
    if head.requires_grad:
        raise ValueError("linear_cross_entropy: the lm_head is frozen here and must not require grad")
    return LinearCrossEntropy.apply(h, head, labels, rows or rows_within(head.shape[0]))


@dataclass
class LossOut:
    loss: torch.Tensor  # scalar, differentiable
    sums: torch.Tensor  # [5 + 2B] fp32, summable across micro-batches and ranks (see `summarize`)


def dflash_loss(
    h: torch.Tensor,
    labels: torch.Tensor,
    lm_head: torch.Tensor,
    gamma: float | None,
    dpace: float | None = None,
    chunk_rows: int | None = None,
    norm: str = "weights",
    acceptance: float = 0.0,
    soft: str = "none",
    soft_weight: float = 0.5,
    target: torch.Tensor | None = None,
) -> LossOut:
    """h: [b, N*B, H] drafter output (after its norm); labels: [b, N, B] (IGNORE = no loss);
    lm_head: [V, H] frozen. Slot weights: exp(-(k-1)/gamma), or D-PACE with smoothing alpha = dpace
    when that is given (gamma unused). chunk_rows: logits rows per chunk (default from LOGITS_BYTES).
    norm: divide the weighted CE by the sum of the weights or by the number of labels (config.NORMS).
    acceptance: the expected-acceptance term's weight in [0, 1] (module doc); 0: the weighted CE alone.
    soft: config.SOFT_TARGETS, mixed in with soft_weight (soft_targets.py); target: [b, N, B, H] the
    final states before each slot (soft_targets' p), needed unless soft is "none".
    The sums (metrics) are the same whatever the weight: their `loss` is the weighted CE."""
    b, n, B = labels.shape
    keep = labels != IGNORE
    h_sel = h.reshape(b, n, B, -1)[keep]  # [M, H]
    y = labels[keep]  # [M]
    if soft == "none":
        ce, pred = linear_cross_entropy(h_sel, lm_head, y, chunk_rows)  # [M] fp32, [M] long
    else:
        terms = slot_terms(h_sel, lm_head, y, chunk_rows or rows_within(lm_head.shape[0]), target[keep])
        ce, pred = terms.ce, terms.pred
    w = _weights(ce, keep, gamma, dpace)  # [M] fp32, no grad
    denom = (w.sum() if norm == "weights" else w.new_tensor(float(len(w)))).clamp_min(1e-12)
    loss = (w * ce).sum() / denom
    if soft in ("kl", "tv"):
        loss = soft_weight * (w * getattr(terms, soft)).sum() / denom + (1 - soft_weight) * loss
    elif soft == "accept":
        loss = soft_weight * acceptance_loss(rejection_log(terms.tv), keep) + (1 - soft_weight) * loss
    if acceptance == 1:
        loss = acceptance_loss(ce, keep)
    elif acceptance:
        loss = acceptance * acceptance_loss(ce, keep) + (1 - acceptance) * loss
    correct = torch.zeros(b, n, B, dtype=torch.bool, device=h.device)
    correct[keep] = pred == y
    return LossOut(loss, _sums(ce.detach(), w, correct, keep))


def _weights(ce, keep, gamma, dpace) -> torch.Tensor:
    """The weights of the kept slots, in `labels[keep]` order: [M] fp32."""
    if dpace is not None:
        full = torch.zeros(keep.shape, device=ce.device)
        full[keep] = ce.detach()
        return dpace_weights(full, keep, dpace)[keep]
    assert gamma is not None, "exp slot weights need gamma"
    return slot_weights(keep.shape[-1], gamma).to(ce.device).expand(keep.shape)[keep]


def expected_accepted(ce: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """E per block (module doc): ce [M] fp32 in `labels[keep]` order, differentiable; keep [b, N, B]
    bool -> [b, N] fp32, the expected number of leading drafts (slots 1..B-1) accepted."""
    full = ce.new_zeros(keep.shape).masked_scatter(keep, ce)  # [b, N, B], row-major as labels[keep]
    reach = keep[..., 1:].to(ce.dtype).cumprod(-1)  # [b, N, K]: 0 from the first unlabelled slot on
    return (torch.exp(-full[..., 1:].cumsum(-1)) * reach).sum(-1)  # A_j summed over j


def acceptance_loss(ce: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """L_acc = mean over counted blocks of 1 - E/K (K = B-1): a scalar, 0 when no block counts."""
    n = keep[..., 1].sum()  # blocks that count, as `_sums` counts them; the others have E = 0
    k = max(keep.shape[-1] - 1, 1)
    return (n - expected_accepted(ce, keep).sum() / k) / n.clamp_min(1)


def zero_sums(block_size: int, device=None) -> torch.Tensor:
    """An empty `LossOut.sums` accumulator: [5 + 2B] fp32."""
    return torch.zeros(5 + 2 * block_size, device=device)


def streaks(correct: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """[b, N, B] -> [b, N]: leading correct drafts from slot 1, stopping at the first miss or
    missing label (the replay acceptance of that block, bonus not counted)."""
    ok = (correct & keep)[..., 1:].long()
    return ok.cumprod(-1).sum(-1)


def _sums(ce, w, correct, keep) -> torch.Tensor:
    blocks = keep[..., 1]  # a block counts when its first draft has a label
    per_slot_ok = (correct & keep).flatten(0, 1).sum(0).float()  # [B]
    per_slot_n = keep.flatten(0, 1).sum(0).float()  # [B]
    head = torch.stack(
        [(w * ce).sum(), w.sum(), (streaks(correct, keep)[blocks] + 1).sum().float(), blocks.sum().float(), ce.sum()]
    )
    return torch.cat([head.float(), per_slot_ok, per_slot_n])


def summarize(sums: torch.Tensor) -> dict:
    """Totals from `LossOut.sums` (possibly added over steps and ranks) -> readable metrics.

    loss: weighted CE (with the run's slot weights, divided by their sum); ce: the plain mean CE over
    labelled slots (comparable across slot weightings); tau_streak: mean over blocks of (leading
    correct drafts + 1), i.e. the expected tokens per round with the bonus counted; acc: per slot
    1..B-1."""
    s = sums.double().cpu().tolist()
    B = (len(s) - 5) // 2
    ok, n = s[5 : 5 + B], s[5 + B :]
    return {
        "loss": s[0] / s[1] if s[1] else math.nan,
        "ce": s[4] / sum(n) if sum(n) else math.nan,
        "tau_streak": s[2] / s[3] if s[3] else math.nan,
        "acc": [round(ok[k] / n[k], 4) if n[k] else None for k in range(1, B)],
        "blocks": int(s[3]),
        "labels": int(sum(n)),
    }

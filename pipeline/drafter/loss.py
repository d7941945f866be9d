"""The DFlash loss and its metrics (SPEC §2, Training).

loss = sum over labelled slots of w_k * CE_k / sum of their w_k, with w_k = exp(-(k-1)/gamma) for
slot k >= 1 and w_0 = 0 (slot 0 is the anchor's own token). Hard labels only. Logits are made only
for labelled slots, in chunks recomputed on backward, so a 248k vocabulary does not hold
[tokens, V] activations for the whole batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from pipeline.drafter.blocks import IGNORE


def slot_weights(block_size: int, gamma: float) -> torch.Tensor:
    """[B] fp32: 0 for slot 0, exp(-(k-1)/gamma) for slot k >= 1."""
    k = torch.arange(block_size, dtype=torch.float32)
    w = torch.exp(-(k - 1) / gamma)
    w[0] = 0.0
    return w


@dataclass
class LossOut:
    loss: torch.Tensor  # scalar, differentiable
    sums: torch.Tensor  # [4 + 2B] fp32, summable across micro-batches and ranks (see `summarize`)


def _ce_pred(h, head, labels):
    logits = F.linear(h.to(head.dtype), head).float()
    return F.cross_entropy(logits, labels, reduction="none"), logits.argmax(-1)


def dflash_loss(h: torch.Tensor, labels: torch.Tensor, lm_head: torch.Tensor, gamma: float,
                chunk: int = 4096) -> LossOut:
    """h: [b, N*B, H] drafter output (after its norm); labels: [b, N, B] (IGNORE = no loss);
    lm_head: [V, H] frozen."""
    b, n, B = labels.shape
    keep = labels != IGNORE
    h_sel = h.reshape(b, n, B, -1)[keep]  # [M, H]
    y = labels[keep]  # [M]
    w = slot_weights(B, gamma).to(h.device)[None, None].expand(b, n, B)[keep]  # [M]
    ce, pred = [], []
    for lo in range(0, len(y), chunk):
        hs, ys = h_sel[lo:lo + chunk], y[lo:lo + chunk]
        if hs.requires_grad and len(y) > chunk:  # recompute only when the logits are really cut up
            c, p = checkpoint(_ce_pred, hs, lm_head, ys, use_reentrant=False)
        else:
            c, p = _ce_pred(hs, lm_head, ys)
        ce.append(c)
        pred.append(p)
    ce = torch.cat(ce) if ce else h.new_zeros(0, dtype=torch.float32)
    pred = torch.cat(pred) if pred else y.new_zeros(0)
    wsum = w.sum()
    loss = (w * ce).sum() / wsum.clamp_min(1e-12)
    correct = torch.zeros(b, n, B, dtype=torch.bool, device=h.device)
    correct[keep] = pred == y
    return LossOut(loss, _sums(ce.detach(), w, correct, keep))


def zero_sums(block_size: int, device=None) -> torch.Tensor:
    """An empty `LossOut.sums` accumulator: [4 + 2B] fp32."""
    return torch.zeros(4 + 2 * block_size, device=device)


def streaks(correct: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """[b, N, B] -> [b, N]: leading correct drafts from slot 1, stopping at the first miss or
    missing label (the replay acceptance of that block, bonus not counted)."""
    ok = (correct & keep)[..., 1:].long()
    return ok.cumprod(-1).sum(-1)


def _sums(ce, w, correct, keep) -> torch.Tensor:
    blocks = keep[..., 1]  # a block counts when its first draft has a label
    per_slot_ok = (correct & keep).flatten(0, 1).sum(0).float()  # [B]
    per_slot_n = keep.flatten(0, 1).sum(0).float()  # [B]
    head = torch.stack([(w * ce).sum(), w.sum(), (streaks(correct, keep)[blocks] + 1).sum().float(),
                        blocks.sum().float()])
    return torch.cat([head.float(), per_slot_ok, per_slot_n])


def summarize(sums: torch.Tensor) -> dict:
    """Totals from `LossOut.sums` (possibly added over steps and ranks) -> readable metrics.

    loss: weighted CE; tau_streak: mean over blocks of (leading correct drafts + 1), i.e. the
    expected tokens per round with the bonus counted; acc: per slot 1..B-1."""
    s = sums.double().cpu().tolist()
    B = (len(s) - 4) // 2
    ok, n = s[4:4 + B], s[4 + B:]
    return {
        "loss": s[0] / s[1] if s[1] else math.nan,
        "tau_streak": s[2] / s[3] if s[3] else math.nan,
        "acc": [round(ok[k] / n[k], 4) if n[k] else None for k in range(1, B)],
        "blocks": int(s[3]),
        "labels": int(sum(n)),
    }

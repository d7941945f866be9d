"""The DSpark objective (`--head dspark`): per labelled slot, 0.9 TV + 0.1 CE of the drafter's
distribution with the transition bias, plus the confidence head's binary cross-entropy.

Slot k's logits are the backbone's plus the Markov bias of the token before it: the anchor at slot 1,
the target's token at slot k-1 after it (teacher forcing: at decode the previous draft is that token
whenever slot k is reached at all). With hard labels TV toward the one-hot target is 1 - p(y), the
drafter's probability of the target's token. The slots are weighted as the DFlash CE is (exp decay or
D-PACE, divided by the weights or the labels: loss.py), the mix taking the CE's place.

The confidence head learns whether the slot's greedy draft is the target's token (the acceptance of
that slot given the earlier ones were accepted, as vLLM reads it), by binary cross-entropy with
weight CONFIDENCE_WEIGHT. Its inputs are detached: it is a probe of the drafter and moves nothing
else.

Logits are made a bounded chunk of rows at a time (loss.rows_within) under activation checkpointing,
so neither pass holds [rows, V] for the whole batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from pipeline.drafter.blocks import IGNORE
from pipeline.drafter.dspark import ConfidenceHead, MarkovHead
from pipeline.drafter.loss import LossOut, _sums, _weights

TV_WEIGHT = 0.9  # DSpark's mix: 0.9 TV + 0.1 CE
CONFIDENCE_WEIGHT = 0.1  # the confidence head's BCE, added


def _chunk(h: torch.Tensor, embed: torch.Tensor, lm_head: torch.Tensor, w2: torch.Tensor, y: torch.Tensor):
    """h: [r, H]; embed: [r, rank]; y: [r] -> (ce [r] fp32, pred [r] long)."""
    z = F.linear(h.to(lm_head.dtype), lm_head).float() + F.linear(embed, w2).float()  # [r, V] fp32
    logp = torch.log_softmax(z, dim=-1)
    return -logp.gather(1, y[:, None]).squeeze(1), z.argmax(-1)


def slot_terms(h, embed, lm_head, markov: MarkovHead, y, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ce [M] fp32, differentiable in h and the Markov head; pred [M] long), chunk by chunk."""
    ce, pred = [], []
    w2 = markov.markov_w2.weight
    for lo in range(0, len(y), rows):
        sl = slice(lo, lo + rows)
        c, p = checkpoint(_chunk, h[sl], embed[sl], lm_head, w2, y[sl], use_reentrant=False)
        ce.append(c)
        pred.append(p)
    return torch.cat(ce), torch.cat(pred)


def dspark_loss(
    h: torch.Tensor,
    labels: torch.Tensor,
    prev: torch.Tensor,
    lm_head: torch.Tensor,
    markov: MarkovHead,
    confidence: ConfidenceHead,
    gamma: float | None,
    dpace: float | None = None,
    chunk_rows: int = 4096,
    norm: str = "weights",
) -> LossOut:
    """h: [b, N*B, H] drafter output (after its norm); labels, prev: [b, N, B] (prev: the token before
    each slot); lm_head: [V, H] frozen. Slot weights and norm as loss.dflash_loss; its metrics too
    (with the bias in: the `loss` of the sums is the weighted CE)."""
    b, n, B = labels.shape
    keep = labels != IGNORE
    h_sel = h.reshape(b, n, B, -1)[keep]  # [M, H]
    y = labels[keep]  # [M]
    embed = markov.embed(prev[keep])  # [M, r]
    ce, pred = slot_terms(h_sel, embed, lm_head, markov, y, chunk_rows)
    w = _weights(ce, keep, gamma, dpace)  # [M] fp32, no grad
    mix = TV_WEIGHT * (1 - torch.exp(-ce)) + (1 - TV_WEIGHT) * ce  # [M]
    denom = (w.sum() if norm == "weights" else w.new_tensor(float(len(w)))).clamp_min(1e-12)
    hit = pred == y
    conf = confidence(h_sel.detach(), embed.detach())  # [M] fp32 logits
    bce = F.binary_cross_entropy_with_logits(conf, hit.float()) if len(y) else conf.sum()
    loss = (w * mix).sum() / denom + CONFIDENCE_WEIGHT * bce
    correct = torch.zeros(b, n, B, dtype=torch.bool, device=h.device)
    correct[keep] = hit
    return LossOut(loss, _sums(ce.detach(), w, correct, keep))


def previous_tokens(tokens: torch.Tensor, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """tokens: [b, T]; anchors: [b, N] -> [b, N, B] long: the token before each slot (slot k: the
    token at anchor + k - 1, so slot 1's is the anchor; slot 0 is never labelled)."""
    T = tokens.shape[1]
    pos = anchors[..., None] + torch.arange(block_size, device=anchors.device) - 1  # [b, N, B]
    pos = pos.clamp(0, T - 1)
    row = torch.arange(tokens.shape[0], device=tokens.device)[:, None, None]
    return tokens[row, pos]

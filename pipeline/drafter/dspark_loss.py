"""The DSpark objective (`--head dspark`): per labelled slot, 0.9 TV + 0.1 CE of the drafter's
distribution with the transition bias, plus the confidence head's binary cross-entropy.

Slot k's logits are the backbone's plus the Markov bias of the token before it: the anchor at slot 1,
the target's token at slot k-1 after it (teacher forcing: at decode the previous draft is that token
whenever slot k is reached at all). With hard labels TV toward the one-hot target is 1 - p(y), the
drafter's probability of the target's token; with --soft-targets tv, TV toward the target's own distribution
(soft_targets.py: from the stored final states). The slots are weighted as the DFlash CE is (exp decay or
D-PACE, divided by the weights or the labels: loss.py), the mix taking the CE's place.

The confidence head learns whether the slot's greedy draft is the target's token (the acceptance of
that slot given the earlier ones were accepted, as vLLM reads it), by binary cross-entropy with
weight CONFIDENCE_WEIGHT. Its inputs are detached: it is a probe of the drafter and moves nothing
else.

Logits are made a bounded chunk of rows at a time (soft_targets.slot_terms) under activation
checkpointing, so neither pass holds [rows, V] for the whole batch.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pipeline.drafter.blocks import IGNORE
from pipeline.drafter.dspark import ConfidenceHead, MarkovHead
from pipeline.drafter.loss import LossOut, _sums, _weights
from pipeline.drafter.soft_targets import slot_terms

TV_WEIGHT = 0.9  # DSpark's mix: 0.9 TV + 0.1 CE
CONFIDENCE_WEIGHT = 0.1  # the confidence head's BCE, added


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
    target: torch.Tensor | None = None,
) -> LossOut:
    """h: [b, N*B, H] drafter output (after its norm); labels, prev: [b, N, B] (prev: the token before
    each slot); lm_head: [V, H] frozen. Slot weights and norm as loss.dflash_loss; its metrics too
    (with the bias in: the `loss` of the sums is the weighted CE). target: [b, N, B, H] the final states
    before each slot (--soft-targets tv): the TV is then toward the target's distribution, not its token."""
    b, n, B = labels.shape
    keep = labels != IGNORE
    h_sel = h.reshape(b, n, B, -1)[keep]  # [M, H]
    y = labels[keep]  # [M]
    embed = markov.embed(prev[keep])  # [M, r]
    bias = (embed, markov.markov_w2.weight)
    terms = slot_terms(h_sel, lm_head, y, chunk_rows, None if target is None else target[keep], bias)
    ce, pred = terms.ce, terms.pred
    w = _weights(ce, keep, gamma, dpace)  # [M] fp32, no grad
    tv = 1 - torch.exp(-ce) if target is None else terms.tv  # hard: 1 - q(y)
    mix = TV_WEIGHT * tv + (1 - TV_WEIGHT) * ce  # [M]
    denom = (w.sum() if norm == "weights" else w.new_tensor(float(len(w)))).clamp_min(1e-12)
    hit = pred == y
    conf = confidence(h_sel.detach(), embed.detach())  # [M] fp32 logits
    bce = F.binary_cross_entropy_with_logits(conf, hit.float()) if len(y) else conf.sum()
    loss = (w * mix).sum() / denom + CONFIDENCE_WEIGHT * bce
    correct = torch.zeros(b, n, B, dtype=torch.bool, device=h.device)
    correct[keep] = hit
    return LossOut(loss, _sums(ce.detach(), w, correct, keep))

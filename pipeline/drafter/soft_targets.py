"""Soft targets (`--soft-targets`): each labelled slot's loss toward the target's own distribution, not only
its token.

The target's distribution at slot k is p = softmax(lm_head(f)) with f the stored final state of the
position before the slot (the state after the target's final norm that predicted the slot's token:
`pipeline extract --final-state`), at temperature 1 (the target's own distribution), through the same
frozen lm_head as the drafter's. q is the drafter's softmax at the slot (a dspark drafter's with the
transition bias of the token before it). Per slot:

- kl: KL(p || q) = sum_x p(x) (log p(x) - log q(x)), distillation's forward KL (its gradient in the
  drafter's logits is q - p; CE's is q - onehot(y)).
- tv: TV(p, q) = 1/2 sum_x |p(x) - q(x)| = 1 - alpha, alpha = sum_x min(p(x), q(x)) the chance that a
  draft sampled from q is accepted against p (speculative sampling at T=1: sampled_acceptance.py). With a
  one-hot p it is 1 - q(y), the hard TV DSpark's objective uses.
- accept: the expected-acceptance term (loss.py) with alpha_k = 1 - TV_k in place of exp(-CE_k):
  L = 1 - E/(B-1), E = sum over j of alpha_1 ... alpha_j.

Mixed with the cross-entropy toward the reference token by --soft-weight w: w * soft + (1 - w) * CE, the
slot weights (exp or D-PACE, from the CE as before) weighting the kl and tv terms and the CE alike; the
accept term weights its slots itself, as the hard one does. A dspark drafter takes `tv` only, as the TV
share of its own 0.9 TV + 0.1 CE (dspark_loss.py).

Logits are made a bounded chunk of rows at a time under activation checkpointing (SOFT_CHUNK: about
four [rows, V] fp32 at once where the fused CE holds one), so neither pass holds [rows, V] for the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

SOFT_CHUNK = 4  # the soft terms' chunk holds about this many [rows, V] fp32 tensors: rows / SOFT_CHUNK a chunk


@dataclass(frozen=True)
class SlotTerms:
    """Per labelled slot, in `labels[keep]` order: CE and argmax always; KL and TV toward p with a target."""

    ce: torch.Tensor  # [M] fp32, differentiable
    pred: torch.Tensor  # [M] long
    kl: torch.Tensor | None = None  # [M] fp32, differentiable
    tv: torch.Tensor | None = None  # [M] fp32, differentiable


def _chunk(h, lm_head, y, target, embed, w2):
    """h: [r, H]; y: [r]; target: [r, H] final states or None; embed: [r, rank] or None (with w2 [V, rank])
    -> (ce [r], pred [r]) and, with a target, (kl [r], tv [r]), all fp32 but pred."""
    z = F.linear(h.to(lm_head.dtype), lm_head).float()  # [r, V] fp32
    if embed is not None:
        z = z + F.linear(embed, w2).float()
    logq = torch.log_softmax(z, dim=-1)
    ce, pred = -logq.gather(1, y[:, None]).squeeze(1), z.argmax(-1)
    if target is None:
        return ce, pred
    logp = torch.log_softmax(F.linear(target.to(lm_head.dtype), lm_head).float(), dim=-1)  # frozen: no grad
    p = logp.exp()
    kl = (p * (logp - logq)).sum(-1)
    tv = 0.5 * (p - logq.exp()).abs().sum(-1)  # not 1 - sum min(p, q): no fp32 cancellation near 0
    return ce, pred, kl, tv


def slot_terms(
    h: torch.Tensor,
    lm_head: torch.Tensor,
    y: torch.Tensor,
    rows: int,
    target: torch.Tensor | None = None,
    bias: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> SlotTerms:
    """h: [M, H] the kept slots' drafter states; lm_head: [V, H] frozen; y: [M] their tokens; rows: logits rows
    per chunk; target: [M, H] the final states before them (soft terms), or None; bias: a dspark drafter's
    (embed [M, rank] of the token before each slot, markov_w2 [V, rank]), or None."""
    if target is not None:
        rows = max(1, rows // SOFT_CHUNK)
    parts = []
    for lo in range(0, max(len(y), 1), rows):  # one empty chunk for no slot: its terms keep the graph
        sl = slice(lo, lo + rows)
        embed, w2 = (bias[0][sl], bias[1]) if bias is not None else (None, None)
        t = None if target is None else target[sl]
        parts.append(checkpoint(_chunk, h[sl], lm_head, y[sl], t, embed, w2, use_reentrant=False))
    return SlotTerms(*(torch.cat(column) for column in zip(*parts)))


def rejection_log(tv: torch.Tensor) -> torch.Tensor:
    """-log alpha = -log(1 - TV), the form loss.expected_accepted reads in place of CE (it takes exp(-x) of
    it): [M] fp32."""
    return -torch.log((1 - tv).clamp_min(1e-12))

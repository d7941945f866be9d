"""The DSpark heads (`--head dspark`) on the DFlash backbone, in vLLM 0.32's Qwen3DSparkModel layout.

- Markov transition head: the previous token's r-dim embedding `markov_w1[prev]` ([V, r]) projected
  back to a vocabulary bias by `markov_w2` ([V, r], applied as x @ w2.T); slot k's logits are the
  backbone's plus the bias of the token before it. Drafting is sequential over the block: slot 1's
  previous token is the anchor, slot k's is the drafter's own choice at slot k-1 (greedy here, as
  vLLM drafts with draft_sample_method greedy).
- Confidence head: one logit from [normed hidden, Markov embedding] (fp32), sigmoid = the chance that
  the slot's draft is accepted given the drafts before it were. vLLM reads it only for adaptive
  verification (enable_adaptive_verification, off by default); acceptance ignores it.

Parameter names are vLLM's (`markov_head.markov_w1.weight`, `markov_head.markov_w2.weight`,
`confidence_head.proj.weight`, `confidence_head.proj.bias`), so a checkpoint loads there as it is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.drafter.config import DrafterConfig


class MarkovHead(nn.Module):
    def __init__(self, c: DrafterConfig) -> None:
        super().__init__()
        self.markov_w1 = nn.Embedding(c.vocab_size, c.markov_rank)
        self.markov_w2 = nn.Linear(c.markov_rank, c.vocab_size, bias=False)

    def embed(self, prev: torch.Tensor) -> torch.Tensor:
        # prev: [...] long -> [..., r] in the parameters' dtype
        return self.markov_w1(prev)

    def bias(self, embed: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
        # embed: [..., r] -> [..., V]; in `dtype` (the base logits' dtype, as vLLM adds them) when given
        w = self.markov_w2.weight
        return F.linear(embed.to(dtype or w.dtype), w.to(dtype or w.dtype))


class ConfidenceHead(nn.Module):
    def __init__(self, c: DrafterConfig) -> None:
        super().__init__()
        self.proj = nn.Linear(c.hidden_size + c.markov_rank, 1, bias=True)

    def forward(self, h: torch.Tensor, embed: torch.Tensor) -> torch.Tensor:
        # h: [..., H] normed hidden; embed: [..., r] -> [...] fp32 logits (sigmoid: acceptance chance)
        x = torch.cat([h, embed.to(h.dtype)], dim=-1).float()
        return F.linear(x, self.proj.weight.float(), self.proj.bias.float()).squeeze(-1)


@torch.no_grad()
def sequential_drafts(base: torch.Tensor, first: torch.Tensor, head: MarkovHead) -> torch.Tensor:
    """Greedy drafting with the transition bias, slot after slot. base: [n, D, V] the backbone's
    logits of slots 1..B-1; first: [n] long, the anchors -> [n, D] long drafts."""
    prev, out = first, []
    for i in range(base.shape[1]):
        prev = (base[:, i] + head.bias(head.embed(prev), base.dtype)).argmax(-1)  # [n]
        out.append(prev)
    return torch.stack(out, dim=1)

"""Sampled references, reproducible row by row: each row's seed, its uniform draws, and one sampling
step over a batch of logits.

A row's seed is a hash of the run's seed and the row's dataset index (`row_seed`), and its k-th
completion token is drawn by inverse CDF with the k-th uniform of that seed (`uniform`): a counter,
not a random stream, so a row's draws depend on nothing but (seed, row, k). Which rows share its
batch, the batch size, the shard schedule and the processes never enter. The token then depends only
on the row's own logits; where batching changes those (kernels, padding), only a draw that falls
within that difference of a boundary between two tokens can change, as greedy's near-ties can.

`RowSampler` is that step as a transformers logits processor: it draws each row's token and leaves
it the only finite score, so `generate`'s greedy argmax (do_sample=False) takes it. transformers'
own sampling draws the whole batch from one global generator, which is why it is not used.
"""

from __future__ import annotations

import hashlib

import torch
from transformers import LogitsProcessor

from store.format.schema import Sampling

_SCALE = 2.0**-53  # 53 random bits -> a double in [0, 1)


def _hash64(text: str) -> int:
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "big")


def row_seed(seed: int, row: int) -> int:
    """The seed of dataset row `row` under the run's `seed`: 63 bits, what a server's request carries."""
    return _hash64(f"dflash-sample:{seed}:{row}") >> 1


def uniform(seed: int, step: int) -> float:
    """The draw of completion token `step` (0-based) of the row with seed `seed` (row_seed): in [0, 1)."""
    return (_hash64(f"{seed}:{step}") >> 11) * _SCALE


def draw(logits: torch.Tensor, u: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """One token per row. logits: [B, V] float; u: [B] in [0, 1). The distribution is softmax(logits /
    temperature) cut to the top_k most likely tokens, then to the nucleus: the tokens whose more
    likely tokens weigh less than top_p (the smallest most-likely set reaching top_p; both cuts keep
    every token tied with the last one kept, so no order among equals is needed). The token is where
    u * (the mass kept) falls on the cumulative sum of what is kept, in vocabulary order (float64).
    Returns [B] long."""
    probs = (logits.double() / sampling.temperature).softmax(-1)  # [B, V]
    if sampling.top_k is not None and sampling.top_k < probs.shape[-1]:
        kth = probs.topk(sampling.top_k, dim=-1).values[:, -1:]  # [B, 1]
        probs = probs.masked_fill(probs < kth, 0.0)
    if sampling.top_p is not None:
        probs = probs.masked_fill(probs < _nucleus_floor(probs, sampling.top_p), 0.0)
    cdf = probs.cumsum(-1)  # [B, V]
    at = (u.to(cdf) * cdf[:, -1]).unsqueeze(-1)  # [B, 1]
    return torch.searchsorted(cdf, at, right=True).clamp_(max=cdf.shape[-1] - 1).squeeze(-1)


def _nucleus_floor(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The least probability in each row's nucleus: [B, 1]. Read from the rows' 1,024 (else 16,384)
    largest probabilities when the nucleus of every row ends among them (a partial sort: a full one
    of a 248k vocabulary takes ~1 s a step on a CPU core), else from all of them."""
    vocab = probs.shape[-1]
    for k in sorted({min(1024, vocab), min(16384, vocab), vocab}):
        top = probs.topk(k, dim=-1).values  # [B, k], largest first
        before = top.cumsum(-1) - top  # the mass ahead of each (of all its ties, for a tie's first)
        last = (before < top_p).sum(-1, keepdim=True) - 1  # [B, 1]: the last one the nucleus keeps
        if k == vocab or bool((last < k - 1).all()):
            return top.gather(-1, last)
    raise AssertionError("unreachable: the full ranking always holds the nucleus")


class RowSampler(LogitsProcessor):
    """Each row's token drawn with its own seed (`draw`), the only finite score left in its row.
    seeds: one per row of the batch (row_seed); width: the batch's padded prompt width, so that the
    step of a call is input_ids' width less it."""

    def __init__(self, sampling: Sampling, seeds: list[int], width: int, steps: int) -> None:
        self.sampling, self.width = sampling, width
        self.u = torch.tensor([[uniform(s, k) for k in range(steps)] for s in seeds], dtype=torch.float64)  # [B, S]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        step = input_ids.shape[1] - self.width
        tokens = draw(scores, self.u[:, step].to(scores.device), self.sampling)  # [B]
        out = torch.full_like(scores, float("-inf"))
        return out.scatter_(1, tokens.unsqueeze(1), 0.0)

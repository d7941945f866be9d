"""Sampled references, reproducible row by row: each row's seed, its noise, and one sampling step over
a batch of logits.

A row's seed is a hash of the run's seed and the row's dataset index (`row_seed`). Its k-th completion
token is drawn by the Gumbel-max rule (exponential race): the kept token j with the largest
p_j / E_j, where E_j = -log U_j and U_j is a uniform hashed from (row seed, k, j) (`uniforms`: a
counter, not a random stream, in 64-bit integer arithmetic that no device changes; checked on CPU
against the Python-integer reference `mix64`). Which rows share its batch, the
batch size, the shard schedule and the processes never enter: a row's token depends on its seed, its
step and its own logits only. Where batching changes those logits (kernels, padding, bf16 rounding)
the token changes only when the two best of the race are within that difference: as rare as a
greedy near-tie, where an inverse-CDF draw moves with the error summed over the vocabulary (on the
tiny target in bf16, 1 row of 32 changed between batch sizes 16 and 1 at T = 0.7, as greedy's 2,
against 15 with an inverse CDF: docs/extraction.md).

`RowSampler` is that step as a transformers logits processor: it draws each row's token and leaves
it the only finite score, so `generate`'s greedy argmax (do_sample=False) takes it. transformers'
own sampling draws the whole batch from one global generator, which is why it is not used.
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessor

from store.format.schema import Sampling

_MASK = (1 << 64) - 1
_GOLDEN, _M1, _M2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # splitmix64's constants


def mix64(x: int) -> int:
    """splitmix64's step on a 64-bit integer: the reference the tensor version (`_mix64`) must equal."""
    x = (x + _GOLDEN) & _MASK
    x = ((x ^ (x >> 30)) * _M1) & _MASK
    x = ((x ^ (x >> 27)) * _M2) & _MASK
    return x ^ (x >> 31)


def _signed(x: int) -> int:
    """A 64-bit pattern as the int64 torch holds it."""
    return x - (1 << 64) if x >= 1 << 63 else x


def _shr(x: torch.Tensor, s: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's >> keeps the sign)."""
    return (x >> s) & ((1 << (64 - s)) - 1)


def _mix64(x: torch.Tensor) -> torch.Tensor:
    """mix64 on int64 tensors, with the wrapping arithmetic of 64-bit integers."""
    x = x + _signed(_GOLDEN)
    x = (x ^ _shr(x, 30)) * _signed(_M1)
    x = (x ^ _shr(x, 27)) * _signed(_M2)
    return x ^ _shr(x, 31)


def row_seed(seed: int, row: int) -> int:
    """The seed of dataset row `row` under the run's `seed`: 63 bits, what a server's request carries."""
    return mix64(mix64(seed & _MASK) ^ (row & _MASK)) >> 1


def step_key(seed: int, step: int) -> int:
    """The key of completion token `step` (0-based) of the row whose seed is `seed` (row_seed)."""
    return mix64(seed ^ mix64(step & _MASK))


def uniforms(keys: list[int], vocab: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[len(keys), vocab] float64 in (0, 1): token j's uniform under key k is the top 52 bits of
    mix64(k + j x GOLDEN), plus a half, over 2^52 (the same bits on every device)."""
    k = torch.tensor([_signed(x) for x in keys], dtype=torch.int64, device=device)[:, None]  # [B, 1]
    j = torch.arange(vocab, dtype=torch.int64, device=device) * _signed(_GOLDEN)  # [V], wrapping
    return (_shr(_mix64(k + j), 12).double() + 0.5) * 2.0**-52


def draw(logits: torch.Tensor, u: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """One token per row. logits: [B, V] float; u: [B, V] uniforms in (0, 1) (`uniforms`). The
    distribution is softmax(logits / temperature) cut to the top_k most likely tokens, then to the
    nucleus: the tokens whose more likely tokens weigh less than top_p (the smallest most-likely set
    reaching top_p; both cuts keep every token tied with the last one kept, so no order among equals is
    needed). The token is the kept j with the largest p_j / -log(u_j), which is token j with
    probability p_j / (the mass kept). Returns [B] long."""
    probs = (logits.double() / sampling.temperature).softmax(-1)  # [B, V]
    if sampling.top_k is not None and sampling.top_k < probs.shape[-1]:
        kth = probs.topk(sampling.top_k, dim=-1).values[:, -1:]  # [B, 1]
        probs = probs.masked_fill(probs < kth, 0.0)
    if sampling.top_p is not None:
        probs = probs.masked_fill(probs < _nucleus_floor(probs, sampling.top_p), 0.0)
    return (probs.log() - (-u.to(probs).log()).log()).argmax(-1)  # log p_j - log E_j; cut tokens -inf


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
    step of a call is input_ids' width less it. Rows are drawn ROWS at a time (the draws are row by
    row anyway): a few float64 [ROWS, V] tensors at once, ~32 MB each at a 248k vocabulary, whatever
    the batch."""

    ROWS = 16

    def __init__(self, sampling: Sampling, seeds: list[int], width: int) -> None:
        self.sampling, self.seeds, self.width = sampling, seeds, width

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        step, vocab = input_ids.shape[1] - self.width, scores.shape[-1]
        tokens = torch.cat(
            [
                draw(
                    scores[lo : lo + self.ROWS],
                    uniforms([step_key(s, step) for s in self.seeds[lo : lo + self.ROWS]], vocab, scores.device),
                    self.sampling,
                )
                for lo in range(0, len(self.seeds), self.ROWS)
            ]
        )  # [B]
        return torch.full_like(scores, float("-inf")).scatter_(1, tokens.unsqueeze(1), 0.0)

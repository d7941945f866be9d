"""How Target.capture splits its rows into forwards under a token budget (--capture-tokens).

A forward holds rows of one batch right-padded to its longest, so its size is rows x longest
tokens, padding included; the budget bounds that product. Rows are taken longest first, so a
forward's rows have similar lengths and little padding. A row longer than the budget is a forward
of its own, run in chunks of at most `budget` tokens through the model's cache (`chunks`).

No attention mask is passed: with right padding every real token of a causal model sees only
real tokens before it (attention is causal, the Gated DeltaNet recurrence and its short
convolution run forward in time), so the states of real tokens are those of a masked forward and
the padded positions are dropped. SDPA then runs its causal kernel and no [B, 1, W, W] mask is
built.
"""

from __future__ import annotations

from dataclasses import dataclass

# The Gated DeltaNet kernels (fla's and the PyTorch fallback) work in blocks of 64 tokens counted
# from the forward's first token; chunks that start on a multiple of 64 keep those blocks where a
# one-shot forward has them. Measured on the tiny target over a 442-token row in bf16: chunks of
# 64-256 tokens differ from one forward in 6 of 282,880 values (one bf16 step), chunks of 100 in
# 44,097.
GDN_BLOCK = 64


@dataclass(frozen=True)
class CaptureBatch:
    """One forward: the rows (indices into the capture's sequences) and the width they pad to."""

    rows: tuple[int, ...]
    width: int

    @property
    def tokens(self) -> int:
        """Token positions the forward computes, padding included."""
        return len(self.rows) * self.width


def capture_batches(lengths: list[int], budget: int | None) -> list[CaptureBatch]:
    """The forwards for rows of these lengths: each rows x longest <= budget, except a row longer
    than the budget, alone (chunked by `chunks`). budget None: all rows in one forward."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    if budget is None:
        return [CaptureBatch(tuple(order), lengths[order[0]])] if order else []
    batches: list[CaptureBatch] = []
    rows: list[int] = []
    for i in order:
        if rows and (len(rows) + 1) * lengths[rows[0]] > budget:
            batches.append(CaptureBatch(tuple(rows), lengths[rows[0]]))
            rows = []
        rows.append(i)
    if rows:
        batches.append(CaptureBatch(tuple(rows), lengths[rows[0]]))
    return batches


def chunks(width: int, budget: int | None) -> list[tuple[int, int]]:
    """[start, end) column ranges of a forward of this width: one, or, when a single row is longer
    than the budget, chunks of the budget rounded down to a multiple of GDN_BLOCK (of the budget
    itself below GDN_BLOCK)."""
    if budget is None or width <= budget:
        return [(0, width)]
    step = budget // GDN_BLOCK * GDN_BLOCK or budget
    return [(lo, min(lo + step, width)) for lo in range(0, width, step)]

"""Training blocks (SPEC §2): anchors, block inputs, positions and labels.

Block b = [token[a_b], MASK x (B-1)] at positions a_b .. a_b+B-1; slot k (1..B-1) is labelled
token[a_b + k]; slot 0 never has a label; labels past the end or outside the loss mask are
dropped (IGNORE). Labels come from the data tokens only.

A row may hold several documents (packed rows): `starts` [b, T] gives, per token, the row index
where its document begins (all 0 for a row of one document). Anchors are then counted per
document, a label never crosses into the next document, and positions restart at each document.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

IGNORE = -100


def anchor_mask(loss_mask):
    """THE anchor rule: position a may anchor a block iff loss_mask[a] and loss_mask[a+1].
    loss_mask: [T] bool (torch or numpy) -> [T-1] bool, same kind."""
    return loss_mask[:-1] & loss_mask[1:]


def anchor_candidates(loss_mask: torch.Tensor, starts: torch.Tensor | None = None, rule: str = "pair") -> torch.Tensor:
    """loss_mask: [T] bool; starts: [T] long document starts (None: one document) -> the positions
    that may anchor a block: [n] long. rule "pair" (SPEC): loss_mask[a] and loss_mask[a+1] in the
    same document; "single": loss_mask[a]."""
    if rule == "single":
        return torch.nonzero(loss_mask).flatten()
    ok = anchor_mask(loss_mask)
    if starts is not None:
        ok = ok & (starts[:-1] == starts[1:])
    return torch.nonzero(ok).flatten()


def sample_anchors(
    loss_mask: torch.Tensor,
    n: int,
    generator: torch.Generator | None = None,
    budget: int | None = None,
    starts: torch.Tensor | None = None,
    rule: str = "pair",
):
    """Up to n anchors per document, uniform without replacement, sorted per row; padded slots get
    valid=False. A row is one document unless `starts` ([b, T] long, see the module doc) says more.

    budget: at most this many anchors over the whole batch (None: no limit). When the documents'
    capped candidates exceed it, the anchors are drawn uniformly from all documents' candidates
    pooled, skipping those of a document that already has n, so each one's share follows its
    number of candidates. rule: see `anchor_candidates`.
    loss_mask: [b, T] bool -> anchors [b, N] long, valid [b, N] bool (N = the most any row got).
    """
    docs, rows = [], []  # candidates per document, and each document's row
    for i, row in enumerate(loss_mask):
        cand = anchor_candidates(row, None if starts is None else starts[i], rule)
        parts = [cand] if starts is None else _by_document(cand, starts[i])
        docs += parts
        rows += [i] * len(parts)
    if budget is not None and sum(min(len(c), n) for c in docs) > budget:
        chosen = _pooled(docs, n, budget, generator)
    else:
        chosen = [_row_pick(c, n, generator) for c in docs]
    picks = [torch.cat([c for c, r in zip(chosen, rows) if r == i] or [docs[0][:0]]) for i in range(len(loss_mask))]
    width = max(1, max(len(p) for p in picks))
    anchors = torch.zeros(len(picks), width, dtype=torch.long)
    valid = torch.zeros(len(picks), width, dtype=torch.bool)
    for i, p in enumerate(picks):
        anchors[i, : len(p)], valid[i, : len(p)] = p, True
    return anchors, valid


def _by_document(cand: torch.Tensor, starts: torch.Tensor) -> list[torch.Tensor]:
    """A row's candidates (ascending) split by document: one tensor per document that has any."""
    if len(cand) == 0:
        return [cand]
    _, counts = torch.unique_consecutive(starts[cand], return_counts=True)
    return list(torch.split(cand, counts.tolist()))


def _row_pick(cand: torch.Tensor, n: int, generator) -> torch.Tensor:
    if len(cand) > n:
        cand = cand[torch.randperm(len(cand), generator=generator)[:n]].sort().values
    return cand


def _pooled(cands: list[torch.Tensor], n: int, budget: int, generator) -> list[torch.Tensor]:
    """`budget` anchors drawn uniformly from the pooled candidates, at most n per row."""
    pos = torch.cat(cands)  # [C] positions, row after row
    counts = torch.tensor([len(c) for c in cands])  # [b]
    row = torch.repeat_interleave(torch.arange(len(cands)), counts)  # [C]
    order = torch.randperm(len(pos), generator=generator)  # [C] the draw order
    drawn_row = row[order]
    grouped = torch.argsort(drawn_row, stable=True)  # the draws grouped by row, in draw order
    rank = torch.empty_like(order)  # earlier draws from the same row
    rank[grouped] = torch.arange(len(order)) - (torch.cumsum(counts, 0) - counts)[drawn_row[grouped]]
    taken = order[rank < n][:budget]  # the first `budget` draws that find their row not yet full
    return [pos[taken[row[taken] == i]].sort().values for i in range(len(cands))]


@dataclass
class Blocks:
    block_ids: torch.Tensor  # [b, N*B] long: anchor token then MASK
    positions: torch.Tensor  # [b, N*B] long: a_b + j, within the anchor's document
    labels: torch.Tensor  # [b, N, B] long, IGNORE where no loss
    anchors: torch.Tensor  # [b, N] long
    valid: torch.Tensor  # [b, N] bool
    starts: torch.Tensor  # [b, N] long: where each anchor's document begins in its row (0: one per row)


def make_blocks(tokens, loss_mask, anchors, valid, block_size: int, mask_token_id: int, starts=None) -> Blocks:
    """tokens: [b, T] long; loss_mask: [b, T] bool; anchors, valid: [b, N]; starts: [b, T] long
    document starts per token (None: one document per row)."""
    b, n = anchors.shape
    T = tokens.shape[1]
    pos = anchors[..., None] + torch.arange(block_size, device=anchors.device)  # [b, N, B]
    inside = pos < T
    idx = pos.clamp(max=T - 1)
    row = torch.arange(b, device=tokens.device)[:, None, None]
    target = tokens[row, idx]
    keep = inside & loss_mask[row, idx] & valid[..., None]
    first = torch.zeros_like(anchors)
    if starts is not None:
        first = starts[row[..., 0], anchors]  # [b, N]
        keep &= starts[row, idx] == first[..., None]  # never a label from the next document
    keep[..., 0] = False
    labels = torch.where(keep, target, torch.full_like(target, IGNORE))
    block_ids = torch.full_like(target, mask_token_id)
    block_ids[..., 0] = tokens[row[..., 0], anchors]
    return Blocks(
        block_ids.view(b, n * block_size),
        (pos - first[..., None]).view(b, n * block_size),
        labels,
        anchors,
        valid,
        first,
    )


def before_slots(values: torch.Tensor, anchors: torch.Tensor, block_size: int) -> torch.Tensor:
    """values: [b, T, ...] per token; anchors: [b, N] -> [b, N, B, ...]: each slot's value at the position
    before it (slot k: anchor + k - 1, so slot 1's is the anchor's; slot 0, never labelled, clamped to 0).
    The token before each slot (a dspark drafter's transition), the final state that predicted it (soft
    targets)."""
    T = values.shape[1]
    pos = anchors[..., None] + torch.arange(block_size, device=anchors.device) - 1  # [b, N, B]
    pos = pos.clamp(0, T - 1)
    row = torch.arange(values.shape[0], device=values.device)[:, None, None]
    return values[row, pos]

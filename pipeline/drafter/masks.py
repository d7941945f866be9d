"""The training attention mask: ONE predicate, rendered for SDPA (CPU) or flex_attention (CUDA).


Keys are laid out [context 0..S-1 | block 0 | block 1 | ...], queries are the block slots.
Query slot j of block b (anchor a_b, position a_b + j) may see
  - context key kv iff start_b <= kv < a_b (strict: the anchor's own target state does not exist
    yet; start_b is where the anchor's document begins in a packed row, 0 otherwise), and only when
    the anchor is valid;
  - key slot j' of its own block and never another block; a causal layer only j' <= j;
  - with a sliding window, only keys whose position is within the window (both sides when the
    layer is not causal).
A padded (invalid) anchor's slots still see their own block, so no row is empty (no NaN); its
labels are dropped by the loss.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(frozen=True)
class LayerRule:
    causal: bool = False
    window: int | None = None


def allowed(b, q_idx, kv_idx, *, anchors, valid, ctx_len: int, block_size: int, rule: LayerRule, starts=None):
    """May query q_idx of batch row b attend to key kv_idx? Pure torch ops: broadcasts, and works
    as a flex_attention mask_mod. anchors: [batch, N] long; valid: [batch, N] bool; starts:
    [batch, N] long, the first context key of each anchor's document (None: 0)."""
    blk = q_idx // block_size
    anchor = anchors[b, blk]
    in_ctx = kv_idx < ctx_len
    rel = kv_idx - ctx_len
    same_block = (~in_ctx) & (rel // block_size == blk)
    q_pos = anchor + q_idx % block_size
    k_pos = torch.where(in_ctx, kv_idx, anchor + rel % block_size)
    if rule.causal:
        same_block = same_block & (k_pos <= q_pos)
    seen = in_ctx & (kv_idx < anchor) & valid[b, blk]
    if starts is not None:
        seen = seen & (kv_idx >= starts[b, blk])
    ok = seen | same_block
    if rule.window is not None:
        ok = ok & (q_pos - k_pos < rule.window)
        if not rule.causal:
            ok = ok & (k_pos - q_pos < rule.window)
    return ok


def bool_mask(
    anchors: torch.Tensor, valid: torch.Tensor, ctx_len: int, block_size: int, rule: LayerRule, starts=None
) -> torch.Tensor:
    """For SDPA: [batch, 1, N*B, S + N*B] bool, True = may attend."""
    batch, n = anchors.shape
    dev = anchors.device
    q = torch.arange(n * block_size, device=dev)[None, :, None]
    kv = torch.arange(ctx_len + n * block_size, device=dev)[None, None, :]
    b = torch.arange(batch, device=dev)[:, None, None]
    return allowed(
        b, q, kv, anchors=anchors, valid=valid, ctx_len=ctx_len, block_size=block_size, rule=rule, starts=starts
    )[:, None]


@dataclass
class LocalMask:
    """The same predicate at block-local keys: block b's queries against [context | its own block].

    Every key outside those is masked for block b anyway (blocks never see each other), so SDPA
    over [b*N, heads, B, S+B] computes exactly the dense result without its [N*B, N*B] part.
    `contexts[r]` is how many context keys row r's blocks can see at most (one past the last allowed
    one): a row's context beyond it is masked for all its blocks, so attention may leave it out.
    """

    mask: torch.Tensor  # [batch, N, B, S + B] bool
    block_size: int
    contexts: list[int] = field(init=False)

    def __post_init__(self):
        seen = self.mask[..., : self.mask.shape[-1] - self.block_size].flatten(1, 2).any(1)  # [batch, S]
        last = torch.where(seen, torch.arange(1, seen.shape[1] + 1, device=seen.device), 0).amax(1)
        self.contexts = last.tolist()


def local_mask(
    anchors: torch.Tensor, valid: torch.Tensor, ctx_len: int, block_size: int, rule: LayerRule, starts=None
) -> LocalMask:
    batch, n = anchors.shape
    dev = anchors.device
    blk = torch.arange(n, device=dev)[None, :, None, None]
    q = blk * block_size + torch.arange(block_size, device=dev)[None, None, :, None]
    kv = torch.arange(ctx_len + block_size, device=dev)[None, None, None, :]
    kv = torch.where(kv < ctx_len, kv, kv + blk * block_size)  # local key -> its index in the dense layout
    b = torch.arange(batch, device=dev)[:, None, None, None]
    m = allowed(
        b, q, kv, anchors=anchors, valid=valid, ctx_len=ctx_len, block_size=block_size, rule=rule, starts=starts
    )
    return LocalMask(m, block_size)


TILE = 128  # flex_attention's sparse block: a BlockMask classifies TILE x TILE (query, key) tiles


def block_mask(anchors: torch.Tensor, valid: torch.Tensor, ctx_len: int, block_size: int, rule: LayerRule, starts=None):
    """For flex_attention (CUDA): a BlockMask with the predicate as its mask_mod and its tiles
    classified from the block structure (tile_kinds), in time that grows with rows + tiles rather than
    rows x keys. It is the BlockMask create_block_mask(mask_mod, ...) builds from the dense mask."""
    from torch.nn.attention.flex_attention import BlockMask

    n = anchors.shape[1]
    partial, full = tile_kinds(anchors, valid, ctx_len, block_size, rule, starts)  # [batch, n_q, n_kv] bool each

    def mask_mod(b, _h, q_idx, kv_idx):
        return allowed(
            b,
            q_idx,
            kv_idx,
            anchors=anchors,
            valid=valid,
            ctx_len=ctx_len,
            block_size=block_size,
            rule=rule,
            starts=starts,
        )

    return BlockMask.from_kv_blocks(
        *ordered(partial),
        *ordered(full),
        BLOCK_SIZE=TILE,
        mask_mod=mask_mod,
        seq_lengths=(n * block_size, ctx_len + n * block_size),
    )


def tile_kinds(
    anchors, valid, ctx_len: int, block_size: int, rule: LayerRule, starts=None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(partial, full): [batch, n_q, n_kv] bool over the TILE x TILE (query, key) tiles. Each query row
    sees two key spans (visible_spans); a tile's count of allowed pairs follows from the spans. A tile
    cut short by the query or key length is never full (create_block_mask pads it with False)."""
    n_q = -(-anchors.shape[1] * block_size // TILE)
    n_kv = -(-(ctx_len + anchors.shape[1] * block_size) // TILE)
    lo, hi = visible_spans(anchors, valid, ctx_len, block_size, rule, starts)  # [batch, N*B, 2] each
    pairs = (ramp_sums(lo, n_q, n_kv) - ramp_sums(hi, n_q, n_kv)).diff(dim=-1)  # [batch, n_q, n_kv]
    full = pairs == TILE * TILE
    return (pairs > 0) & ~full, full


def visible_spans(anchors, valid, ctx_len: int, block_size: int, rule: LayerRule, doc_starts=None):
    """The predicate per query row as two half-open key spans, [context span, own-block span]: row
    (b, j) sees context keys [a_b + j - window + 1, a_b) clipped to [start_b, S) (none if b is
    padded; start_b the anchor's document start, 0 without doc_starts) and
    keys S + b*B + [j - window + 1, j] (causal) or [j - window + 1, j + window) (bidirectional),
    clipped to its block. Returns starts, ends: [batch, N*B, 2] long, end >= start (empty: equal)."""
    n = anchors.shape[1]
    j = torch.arange(block_size, device=anchors.device)  # [B] slot in the block
    a = anchors[:, :, None].long()  # [batch, N, 1]
    w = rule.window
    first = doc_starts[:, :, None].long() if doc_starts is not None else torch.zeros_like(a)  # [batch, N, 1]
    ctx_lo = torch.maximum(a + j - w + 1, first) if w is not None else first.expand_as(a + j)  # [batch, N, B]
    ctx_hi = torch.where(valid[:, :, None], a.clamp(max=ctx_len), 0).expand_as(ctx_lo)
    own_lo, own_hi = torch.zeros_like(j), torch.full_like(j, block_size)  # [B] slots of its own block
    if w is not None:
        own_lo, own_hi = (j - w + 1).clamp(min=0), (j + w).clamp(max=block_size)
    if rule.causal:
        own_hi = j + 1
    base = ctx_len + torch.arange(n, device=anchors.device)[None, :, None] * block_size  # [1, N, 1] block's 1st key
    starts = torch.stack((ctx_lo, (base + own_lo).expand_as(ctx_lo)), dim=-1)  # [batch, N, B, 2]
    ends = torch.stack((ctx_hi, (base + own_hi).expand_as(ctx_lo)), dim=-1)
    return starts.flatten(1, 2), torch.maximum(ends, starts).flatten(1, 2)


def ramp_sums(points: torch.Tensor, n_q: int, n_kv: int) -> torch.Tensor:
    """points: [batch, Q, 2] key indices -> [batch, n_q, n_kv + 1]: sum of max(x - p, 0) over the
    points p of each query tile, at every key-tile edge x = TILE * u. For one span [s, e) the ramp at
    s minus the ramp at e counts its keys below x, so differences across edges count keys per tile.
    Points are bucketed by tile (p < TILE * u iff p // TILE < u), then prefix counts and sums."""
    batch, q, k = points.shape
    tile_of_row = (torch.arange(q, device=points.device) // TILE)[None, :, None]
    bucket = (tile_of_row * (n_kv + 1) + points // TILE).expand(batch, q, k).reshape(batch, -1)
    size = (batch, n_q * (n_kv + 1))
    number = torch.zeros(size, dtype=torch.long, device=points.device).scatter_add_(1, bucket, torch.ones_like(bucket))
    total = torch.zeros(size, dtype=torch.long, device=points.device).scatter_add_(1, bucket, points.reshape(batch, -1))
    number, total = number.view(batch, n_q, n_kv + 1), total.view(batch, n_q, n_kv + 1)
    below, below_sum = number.cumsum(-1) - number, total.cumsum(-1) - total  # points in buckets < u
    edges = torch.arange(n_kv + 1, device=points.device) * TILE
    return edges * below - below_sum


def ordered(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """tiles: [batch, n_q, n_kv] bool -> (number [batch, 1, n_q], indices [batch, 1, n_q, n_kv]) int32:
    each query tile's marked key tiles first, ascending (BlockMask's kv_num_blocks / kv_indices)."""
    number = tiles.sum(-1, dtype=torch.int32)[:, None]
    indices = torch.argsort(tiles.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)[:, None]
    return number.contiguous(), indices.contiguous()


def build(rules, anchors, valid, ctx_len: int, block_size: int, kind: str, starts=None) -> dict:
    """One mask per distinct layer rule: {LayerRule: mask}. kind: "flex" (CUDA), "local" (SDPA per
    block, the CPU default) or "dense" (SDPA over the whole key layout, the reference). starts:
    [batch, N] document start of each anchor, for packed rows (None: one document per row)."""
    make = {"flex": block_mask, "local": local_mask, "dense": bool_mask}[kind]
    return {rule: make(anchors, valid, ctx_len, block_size, rule, starts) for rule in set(rules)}

"""The training attention mask: ONE predicate, rendered for SDPA (CPU) or flex_attention (CUDA).


Keys are laid out [context 0..S-1 | block 0 | block 1 | ...], queries are the block slots.
Query slot j of block b (anchor a_b, position a_b + j) may see
  - context key kv iff kv < a_b (strict: the anchor's own target state does not exist yet), and
    only when the anchor is valid;
  - key slot j' of its own block and never another block; a causal layer only j' <= j;
  - with a sliding window, only keys whose position is within the window (both sides when the
    layer is not causal).
A padded (invalid) anchor's slots still see their own block, so no row is empty (no NaN); its
labels are dropped by the loss.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LayerRule:
    causal: bool = False
    window: int | None = None


def allowed(b, q_idx, kv_idx, *, anchors, valid, ctx_len: int, block_size: int, rule: LayerRule):
    """May query q_idx of batch row b attend to key kv_idx? Pure torch ops: broadcasts, and works
    as a flex_attention mask_mod. anchors: [batch, N] long; valid: [batch, N] bool."""
    blk = q_idx // block_size
    anchor = anchors[b, blk]
    in_ctx = kv_idx < ctx_len
    rel = kv_idx - ctx_len
    same_block = (~in_ctx) & (rel // block_size == blk)
    q_pos = anchor + q_idx % block_size
    k_pos = torch.where(in_ctx, kv_idx, anchor + rel % block_size)
    if rule.causal:
        same_block = same_block & (k_pos <= q_pos)
    ok = (in_ctx & (kv_idx < anchor) & valid[b, blk]) | same_block
    if rule.window is not None:
        ok = ok & (q_pos - k_pos < rule.window)
        if not rule.causal:
            ok = ok & (k_pos - q_pos < rule.window)
    return ok


def bool_mask(anchors: torch.Tensor, valid: torch.Tensor, ctx_len: int, block_size: int, rule: LayerRule) -> torch.Tensor:
    """For SDPA: [batch, 1, N*B, S + N*B] bool, True = may attend."""
    batch, n = anchors.shape
    dev = anchors.device
    q = torch.arange(n * block_size, device=dev)[None, :, None]
    kv = torch.arange(ctx_len + n * block_size, device=dev)[None, None, :]
    b = torch.arange(batch, device=dev)[:, None, None]
    return allowed(b, q, kv, anchors=anchors, valid=valid, ctx_len=ctx_len, block_size=block_size, rule=rule)[:, None]


@dataclass
class LocalMask:
    """The same predicate at block-local keys: block b's queries against [context | its own block].

    Every key outside those is masked for block b anyway (blocks never see each other), so SDPA
    over [b*N, heads, B, S+B] computes exactly the dense result without its [N*B, N*B] part.
    """

    mask: torch.Tensor  # [batch, N, B, S + B] bool
    block_size: int


def local_mask(anchors: torch.Tensor, valid: torch.Tensor, ctx_len: int, block_size: int, rule: LayerRule) -> LocalMask:
    batch, n = anchors.shape
    dev = anchors.device
    blk = torch.arange(n, device=dev)[None, :, None, None]
    q = blk * block_size + torch.arange(block_size, device=dev)[None, None, :, None]
    kv = torch.arange(ctx_len + block_size, device=dev)[None, None, None, :]
    kv = torch.where(kv < ctx_len, kv, kv + blk * block_size)  # local key -> its index in the dense layout
    b = torch.arange(batch, device=dev)[:, None, None, None]
    m = allowed(b, q, kv, anchors=anchors, valid=valid, ctx_len=ctx_len, block_size=block_size, rule=rule)
    return LocalMask(m, block_size)


def block_mask(anchors: torch.Tensor, valid: torch.Tensor, ctx_len: int, block_size: int, rule: LayerRule):
    """For flex_attention (CUDA): a BlockMask from the same predicate."""
    from torch.nn.attention.flex_attention import create_block_mask

    batch, n = anchors.shape

    def mask_mod(b, _h, q_idx, kv_idx):
        return allowed(b, q_idx, kv_idx, anchors=anchors, valid=valid, ctx_len=ctx_len, block_size=block_size, rule=rule)

    return create_block_mask(mask_mod, B=batch, H=None, Q_LEN=n * block_size, KV_LEN=ctx_len + n * block_size,
                             device=anchors.device)


def build(rules, anchors, valid, ctx_len: int, block_size: int, kind: str) -> dict:
    """One mask per distinct layer rule: {LayerRule: mask}. kind: "flex" (CUDA), "local" (SDPA per
    block, the CPU default) or "dense" (SDPA over the whole key layout, the reference)."""
    make = {"flex": block_mask, "local": local_mask, "dense": bool_mask}[kind]
    return {rule: make(anchors, valid, ctx_len, block_size, rule) for rule in set(rules)}

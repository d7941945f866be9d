"""Attention of block queries over [context ; block] keys, by the kernel the mask is made for:
flex_attention with a BlockMask (CUDA training; compiled once per process), SDPA with a dense bool
mask (the reference, and inference), or SDPA per block with a LocalMask (CPU training). masks.py
renders the one predicate for each."""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from pipeline.drafter.masks import LocalMask

FLEX_CACHE_SIZE = 64  # compiled graphs kept: training pads shapes so few repeat (stages/train/step.py)


@functools.cache
def compiled_flex():
    """flex_attention compiled once per process (it has no CPU backward: CUDA training only)."""
    from torch.nn.attention.flex_attention import flex_attention

    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, FLEX_CACHE_SIZE)
    return torch.compile(flex_attention, dynamic=False)


def attend(q, k_ctx, v_ctx, k_blk, v_blk, mask, scale: float) -> torch.Tensor:
    """q: [b, hq, Q, d]; k/v_ctx: [b, hkv, S, d]; k/v_blk: [b, hkv, Q, d] -> [b, hq, Q, d].

    mask: a flex BlockMask, a dense bool tensor [b, 1, Q, S+Q], or a LocalMask (SDPA per block)."""
    if isinstance(mask, LocalMask):
        return _attend_local(q, k_ctx, v_ctx, k_blk, v_blk, mask, scale)
    k, v = torch.cat((k_ctx, k_blk), dim=2), torch.cat((v_ctx, v_blk), dim=2)
    if isinstance(mask, torch.Tensor):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return compiled_flex()(q, k, v, block_mask=mask, scale=scale, enable_gqa=True)


def _attend_local(q, k_ctx, v_ctx, k_blk, v_blk, mask: LocalMask, scale: float) -> torch.Tensor:
    """SDPA with each block as its own batch item: its B queries against [context | its block].

    Rows whose blocks see less context than the padded length (rows of unequal length in a batch)
    are attended one row at a time over the context they can see (LocalMask.contexts)."""
    S, B = k_ctx.shape[2], mask.block_size
    if len(set(mask.contexts)) == 1:
        rows = [slice(None)]
    else:
        rows = [slice(r, r + 1) for r in range(q.shape[0])]
    out = []
    for r in rows:
        c = max(mask.contexts[r])
        m = torch.cat((mask.mask[r][..., :c], mask.mask[r][..., S:]), dim=-1)
        out.append(_local_sdpa(q[r], k_ctx[r][:, :, :c], v_ctx[r][:, :, :c], k_blk[r], v_blk[r], m, B, scale))
    return torch.cat(out)


def _local_sdpa(q, k_ctx, v_ctx, k_blk, v_blk, mask: torch.Tensor, B: int, scale: float) -> torch.Tensor:
    """q: [b, hq, N*B, d]; k/v_ctx: [b, hkv, S, d]; mask: [b, N, B, S+B] -> [b, hq, N*B, d]."""
    b, hq, Q, d = q.shape
    n = Q // B

    def per_block(x):  # [b, h, N*B, d] -> [b, N, h, B, d]
        return x.view(b, x.shape[1], n, B, d).transpose(1, 2)

    def with_ctx(ctx, blk):  # -> [b*N, hkv, S+B, d]
        return torch.cat((ctx[:, None].expand(b, n, *ctx.shape[1:]), per_block(blk)), dim=3).flatten(0, 1)

    out = F.scaled_dot_product_attention(
        per_block(q).flatten(0, 1),
        with_ctx(k_ctx, k_blk),
        with_ctx(v_ctx, v_blk),
        attn_mask=mask.flatten(0, 1)[:, None],
        scale=scale,
        enable_gqa=True,
    )
    return out.view(b, n, hq, B, d).transpose(1, 2).reshape(b, hq, Q, d)

"""Attention for a capture chunk that follows cached positions, with no mask built.

A row longer than the capture budget runs in chunks through the model's cache (Target.capture).
Each chunk after the first has fewer queries than keys: its causal mask is the lower-right
triangle of [chunk, cached + chunk]. Under transformers' `sdpa`, the model builds that mask as a
bool tensor before the first layer (chunk x (cached + chunk) bytes: 8 GiB for the last 64k chunk
of a 128k row) and repeats the keys and values over the query heads to go with it. This
implementation asks for no mask (its mask function returns None) and passes SDPA torch's
lower-right causal bias instead, with grouped-query attention left to SDPA: on CUDA the flash or
memory-efficient kernel applies it without making the mask; without them (CPU) torch materialises
the same [chunk, cached + chunk] mask the model would have built, so the states do not change.

It serves only the chunked forwards of one unpadded row (`chunk_attention(model)`); the target's
own implementation serves everything else, generation included.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

NAME = "capture_chunk_sdpa"  # no "flash" in it: transformers reads such names as flash-attention kernels


def attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query: [1, heads, q, D]; key, value: [1, kv_heads, cached + q, D] -> [1, q, heads, D]."""
    assert attention_mask is None, "a chunk's forward builds no mask"
    q, k = query.shape[2], key.shape[2]
    causal = causal_lower_right(q, k) if k > q else None
    out = F.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=causal,
        dropout_p=dropout,
        is_causal=causal is None and q > 1,
        scale=scaling,
        enable_gqa=getattr(module, "num_key_value_groups", 1) > 1,
    )
    return out.transpose(1, 2).contiguous(), None


def no_mask(*args, **kwargs) -> None:
    """The mask function of NAME: the attention above makes its causal bias itself."""
    return None


def register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, attention)
    AttentionMaskInterface.register(NAME, no_mask)


@contextmanager
def chunk_attention(model: torch.nn.Module):
    """The model's attention switched to NAME for the duration, then back to what it was."""
    config = model.config.get_text_config()
    before = config._attn_implementation
    if before != "sdpa":  # flash attention takes a cache without a mask already; eager keeps its own
        yield
        return
    register()
    model.set_attn_implementation(NAME)
    try:
        yield
    finally:
        model.set_attn_implementation(before)

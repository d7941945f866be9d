"""Drafting at inference: the drafter with a KV cache of its context.

A round appends the target states that became known since the last round (the committed tokens'
states), projecting them once per layer, then runs one block against the whole cached context.
So a round costs the new context plus one block, not the prefix again. The attention rule is the
training predicate with a single anchor at the block's start (`masks.build`).
"""

from __future__ import annotations

import torch

from pipeline.drafter import masks
from pipeline.drafter.model import Drafter


class DraftSession:
    def __init__(self, drafter: Drafter) -> None:
        self.m = drafter
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] | None = None
        self.length = 0  # context positions cached: 0..length-1

    @torch.no_grad()
    def extend(self, hidden: torch.Tensor) -> None:
        """hidden: [s, n_taps, H], the target states of positions length..length+s-1."""
        if hidden.shape[0] == 0:
            return
        dev = self.m.fc.weight.device
        pos = torch.arange(self.length, self.length + hidden.shape[0], device=dev)[None]
        new = self.m.context_kv(self.m.context(hidden[None].to(dev)), pos)
        if self.kv is None:
            self.kv = new
        else:
            self.kv = [(torch.cat((k, nk), 2), torch.cat((v, nv), 2)) for (k, v), (nk, nv) in zip(self.kv, new)]
        self.length += hidden.shape[0]

    @torch.no_grad()
    def draft(self, token: int) -> torch.Tensor:
        """Logits for slots 1..B-1 of the block [token, MASK x (B-1)] at positions length.. : [B-1, V] fp32.

        The context must hold exactly the states strictly before the block's start."""
        c, dev = self.m.config, self.m.fc.weight.device
        B, start = c.block_size, self.length
        ids = torch.full((1, B), c.mask_token_id, dtype=torch.long, device=dev)
        ids[0, 0] = token
        positions = torch.arange(start, start + B, device=dev)[None]
        anchors = torch.tensor([[start]], device=dev)
        mk = masks.build(self.m.rules, anchors, torch.ones_like(anchors, dtype=torch.bool), start, B, "dense")
        kv = self.kv if self.kv is not None else self._empty_kv(dev)
        h = self.m.run_block(kv, ids, positions, mk)  # [1, B, H]
        return self.m.logits(h[0, 1:]).float()

    def _empty_kv(self, dev):
        a = self.m.layers[0].self_attn
        z = torch.zeros(1, a.kv_heads, 0, a.head_dim, device=dev, dtype=self.m.fc.weight.dtype)
        return [(z, z)] * len(self.m.layers)

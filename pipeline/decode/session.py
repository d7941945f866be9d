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
    """The cache is preallocated and doubled when full (never a torch.cat per round)."""

    def __init__(self, drafter: Drafter, capacity: int = 256) -> None:
        self.m = drafter
        a, w = drafter.layers[0].self_attn, drafter.fc.weight
        shape = (1, a.kv_heads, capacity, a.head_dim)
        self.cache = [(w.new_zeros(shape), w.new_zeros(shape)) for _ in drafter.layers]  # per layer (k, v)
        self.length = 0  # context positions cached: 0..length-1

    @property
    def kv(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Per layer (k, v) of the cached context: [1, kv_heads, length, head_dim] views."""
        return [(k[:, :, : self.length], v[:, :, : self.length]) for k, v in self.cache]

    @torch.no_grad()
    def extend(self, hidden: torch.Tensor) -> None:
        """hidden: [s, n_taps, H], the target states of positions length..length+s-1."""
        if hidden.shape[0] == 0:
            return
        dev = self.m.fc.weight.device
        pos = torch.arange(self.length, self.length + hidden.shape[0], device=dev)[None]
        new = self.m.context_kv(self.m.context(hidden[None].to(dev)), pos)
        end = self.length + hidden.shape[0]
        if end > self.cache[0][0].shape[2]:
            self._grow(max(end, 2 * self.cache[0][0].shape[2]))
        for (k, v), (nk, nv) in zip(self.cache, new):
            k[:, :, self.length : end], v[:, :, self.length : end] = nk, nv
        self.length = end

    def _grow(self, capacity: int) -> None:
        grown = []
        for k, v in self.cache:
            shape = (*k.shape[:2], capacity, k.shape[3])
            k2, v2 = k.new_zeros(shape), v.new_zeros(shape)
            k2[:, :, : self.length], v2[:, :, : self.length] = k[:, :, : self.length], v[:, :, : self.length]
            grown.append((k2, v2))
        self.cache = grown

    @torch.no_grad()
    def draft(self, token: int) -> torch.Tensor:
        """Logits for slots 1..B-1 of the block [token, MASK x (B-1)] at positions length.. : [B-1, V] fp32.

        The context must hold exactly the states strictly before the block's start."""
        return self.m.logits(self._block(token)[0, 1:]).float()

    @torch.no_grad()
    def chain(self, token: int) -> torch.Tensor:
        """Greedy chain drafts for slots 1..B-1 of the block [token, MASK x (B-1)]: [B-1] long (a dspark
        drafter's slot after slot: Drafter.chain_drafts)."""
        h = self._block(token)[:, 1:]  # [1, B-1, H]
        return self.m.chain_drafts(h, torch.tensor([token], device=h.device))[0]

    def _block(self, token: int) -> torch.Tensor:
        """The block [token, MASK x (B-1)] at positions length.. through the drafter: [1, B, H] normed."""
        c, dev = self.m.config, self.m.fc.weight.device
        B, start = c.block_size, self.length
        ids = torch.full((1, B), c.mask_token_id, dtype=torch.long, device=dev)
        ids[0, 0] = token
        positions = torch.arange(start, start + B, device=dev)[None]
        anchors = torch.tensor([[start]], device=dev)
        mk = masks.build(self.m.rules, anchors, torch.ones_like(anchors, dtype=torch.bool), start, B, "dense")
        return self.m.run_block(self.kv, ids, positions, mk)

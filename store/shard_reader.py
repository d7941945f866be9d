"""Reads samples back from committed shards (what training and evaluation consume)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pipeline.errors import PipelineError
from store import layout
from store.hidden_store import HiddenStore


@dataclass(frozen=True)
class Sample:
    shard: int
    index: int  # position within the shard
    row_id: int  # dataset row
    tokens: torch.Tensor  # [T] int64
    loss_mask: torch.Tensor  # [T] bool, True exactly on completion tokens
    prompt_len: int
    hidden: torch.Tensor  # [T, n_taps, H] bf16


class ShardReader:
    def __init__(self, store: HiddenStore, shard: int) -> None:
        if store.marker(shard) is None:
            raise PipelineError(f"{store.location}: shard {shard} is not committed")
        self.store, self.shard = store, shard
        g = store.shard_arrays(shard)
        self.hidden = g["hidden"]
        self.tokens = g["tokens"][:]
        self.loss_mask = g["loss_mask"][:]
        self.offsets = g["offsets"][:]
        self.prompt_lens = g["prompt_lens"][:]
        self.row_ids = g["row_ids"][:]

    def __len__(self) -> int:
        return len(self.row_ids)

    def __getitem__(self, i: int) -> Sample:
        return self.read(i)

    def read(self, i: int, limit: int | None = None) -> Sample:
        """Sample i, its first `limit` tokens only when given (only those chunks are read)."""
        if not 0 <= i < len(self):
            raise IndexError(i)
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        if limit is not None:
            b = min(b, a + limit)
        return Sample(
            shard=self.shard, index=i, row_id=int(self.row_ids[i]),
            tokens=torch.from_numpy(self.tokens[a:b].astype(np.int64)),
            loss_mask=torch.from_numpy(self.loss_mask[a:b].astype(bool)),
            prompt_len=int(self.prompt_lens[i]),
            hidden=layout.from_bits(self.hidden[a:b]),
        )

    def __iter__(self):
        for i in range(len(self)):
            yield self[i]

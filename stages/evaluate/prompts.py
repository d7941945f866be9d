"""The stored prompts evaluation replays, read one at a time (a store's held-out shards may not fit
in memory): every sample with a completion, in shard order, the first `limit` when given."""

from __future__ import annotations

import numpy as np

from store.hidden_store import HiddenStore
from store.shard_reader import ShardReader


class Prompts:
    def __init__(self, store: HiddenStore, shards: list[int], limit: int | None) -> None:
        self.store, self.refs = store, []
        self._reader: ShardReader | None = None
        for shard in shards:
            reader = ShardReader(store, shard)  # a completion follows every prompt (pipeline verify checks it)
            lengths = np.diff(reader.offsets)
            self.refs += [(shard, i) for i in range(len(lengths)) if lengths[i] > reader.prompt_lens[i]]
        self.refs = self.refs[:limit]

    def __len__(self) -> int:
        return len(self.refs)

    def __iter__(self):
        for shard, i in self.refs:
            if self._reader is None or self._reader.shard != shard:
                self._reader = ShardReader(self.store, shard)  # one shard's tokens at a time
            yield self._reader[i]

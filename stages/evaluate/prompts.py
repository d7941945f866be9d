"""The stored prompts evaluation replays: every sample with a completion in the chosen shards, or a
fixed random sample of them (seeded, the same on every process), dealt to processes, and read
ahead on a background thread, one at a time (a store's held-out shards may not fit in memory)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator

import numpy as np

from store.hidden_store import HiddenStore
from store.shard_reader import Sample, ShardReader

Ref = tuple[int, int]  # (shard, index within the shard)


class Prompts:
    def __init__(self, store: HiddenStore, shards: list[int], limit: int | None, seed: int) -> None:
        self.store = store
        refs, lengths = [], []
        self.category = {}  # each available prompt's label (--category-field at extraction), when its shard has them
        for shard in shards:
            reader = ShardReader(store, shard)  # a completion follows every prompt (pipeline verify checks it)
            n = np.diff(reader.offsets)
            keep = np.flatnonzero(n > reader.prompt_lens)
            refs += [(shard, int(i)) for i in keep]
            lengths += n[keep].tolist()
            if reader.record.categories is not None:
                self.category.update({(shard, int(i)): reader.record.category(int(i)) for i in keep})
        self.available = len(refs)
        pick = np.arange(len(refs))
        if limit is not None and limit < len(refs):
            pick = np.sort(np.random.default_rng(seed).choice(len(refs), limit, replace=False))
        self.refs: list[Ref] = [refs[i] for i in pick]  # in store order
        self.max_length = max((lengths[i] for i in pick), default=0)

    def __len__(self) -> int:
        return len(self.refs)

    def part(self, rank: int, world: int) -> list[Ref]:
        """This process's prompts: every world-th, from its rank."""
        return self.refs[rank::world]

    def texts(self, refs: list[Ref]) -> list[tuple[np.ndarray, int]]:
        """Per ref, (its stored tokens [T] int32: prompt then completion, prompt length); no states
        read. Arrays, not lists: 4 bytes a token, not ~36 (all of a 2.5M-sample store's held-out part
        would otherwise take tens of GB)."""
        return [(reader.tokens(i), int(reader.prompt_lens[i])) for reader, i in self._walk(refs)]

    def _walk(self, refs: list[Ref]) -> Iterator[tuple[ShardReader, int]]:
        """(the reader of its shard, its index) per ref; refs in store order, so one shard's handles
        are open at a time."""
        reader: ShardReader | None = None
        for shard, i in refs:
            if reader is None or reader.shard != shard:
                reader = ShardReader(self.store, shard)
            yield reader, i

    def read(self, refs: list[Ref], ahead: int = 8) -> Iterator[Sample]:
        """The samples of refs, in order, read by a background thread up to `ahead` samples early."""
        q: queue.Queue = queue.Queue(maxsize=ahead)
        stop = threading.Event()

        def reader() -> None:
            try:
                for current, i in self._walk(refs):
                    item = current[i]
                    while not stop.is_set():
                        try:
                            q.put(item, timeout=0.1)
                            break
                        except queue.Full:
                            continue
                    if stop.is_set():
                        return
            except BaseException as e:  # re-raised in the consuming thread
                q.put(e)
                return
            q.put(None)

        thread = threading.Thread(target=reader, daemon=True, name="prompt-reader")
        thread.start()
        try:
            while (item := q.get()) is not None:
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            stop.set()

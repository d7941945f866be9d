"""A batch of sample refs -> padded tensors read from the store: `StoreBatches` turns a batch
(epoch_order.py) into a `Batch`; it is what the loader's worker processes run (loader.py), each
with its own store handles."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

import torch

from stages.train.epoch_order import Batches, Row
from store.errors import NotCommitted, StoreCorrupt, StoreError, redo_hint
from store.format import layout
from store.hidden_store import HiddenStore
from store.io.node_cache import NodeCache
from store.shard_reader import ShardReader, read_samples


@dataclass
class Batch:
    tokens: torch.Tensor  # [b, T] long, 0 past each length
    loss_mask: torch.Tensor  # [b, T] bool, False past each length
    hidden: torch.Tensor  # [b, T, n_taps, H] bf16, 0 past each length
    lengths: torch.Tensor  # [b] long: tokens of each row
    refs: torch.Tensor  # [D, 2] long: (shard, index) of the D samples, row after row
    starts: torch.Tensor  # [b, T] long: where each token's sample begins in its row (all 0 for one a row)
    final: torch.Tensor | None = None  # [b, T, H] bf16, 0 past each length: the final states (--soft-targets)
    corrupt: tuple = ()  # (shard, index, why) of the samples left empty: their read failed (damaged or missing)
    cache_trouble: str | None = None  # why the worker reads without the node cache (--cache-dir), if it does

    def _map(self, fn) -> "Batch":
        values = (getattr(self, f.name) for f in fields(self))
        return Batch(*(fn(v) if isinstance(v, torch.Tensor) else v for v in values))

    def pin_memory(self) -> "Batch":
        return self._map(torch.Tensor.pin_memory)

    def to(self, device) -> "Batch":
        return self._map(lambda t: t.to(device, non_blocking=True))


class StoreBatches(torch.utils.data.Dataset):
    """batches[i], or a batch given whole, -> a padded Batch. Store handles and shard readers open
    lazily, once per worker process, and stay open for as long as the worker lives: the run's
    loader (`loader`) keeps its workers through every epoch, so a shard's reader, its read cache
    (indexes, edge chunks) and its connections are made once per run, not once per epoch. Read in
    the process that made it (--workers 0), it reads through the store it was given."""

    def __init__(
        self,
        store: HiddenStore | str,
        batches: Batches | list[list[Row]] = (),
        node_cache: NodeCache | None = None,
        final_state: bool = False,
    ) -> None:
        """store: the process's open store (the run's one: stages/train/setup.py), or its location,
        opened at the first read. A loader worker opens its own at the same location and node cache:
        a forked copy of the parent's file system (an object store's sessions, bound to the parent's
        event loop) is not the worker's to use. node_cache: a node-local cache of an object store's
        shard files (--cache-dir), which the readers fetch through (with an open store: the one it
        was opened with). final_state: the batches carry the samples' final states too (Batch.final)."""
        opened = isinstance(store, HiddenStore)
        self.location = store.location if opened else store
        self.batches, self.node_cache, self.final_state = batches, node_cache, final_state
        self._store: HiddenStore | None = store if opened else None
        self._pid = os.getpid()  # the process _store is open in
        self._readers: dict[int, ShardReader] = {}

    def __getstate__(self) -> dict:  # sent to a spawned loader worker: it opens its own store and readers
        return {**self.__dict__, "_store": None, "_readers": {}}

    def __len__(self) -> int:
        return len(self.batches)

    def reader(self, shard: int) -> ShardReader:
        store = self.store  # first: in a loader worker, its own store and readers
        if shard not in self._readers:
            try:
                self._readers[shard] = ShardReader(store, shard)
            except NotCommitted:  # it was committed when the run indexed it
                raise self._gone(shard) from None
        return self._readers[shard]

    def _gone(self, shard: int) -> StoreCorrupt:
        return StoreCorrupt(
            f"{self.store.path(layout.commit_key(shard))}: gone since the run started (shard {shard} "
            "was deleted or cleared under it)",
            redo_hint(self.location, shard),
        )

    def _why(self, shard: int, e: StoreError) -> StoreError:
        """A failed read's error; a shard deleted whole under a reader kept from an earlier batch
        is named as such (its commit file gone), not by the first of its files found missing."""
        try:
            gone = self.store.commit_record(shard) is None
        except StoreError:  # its commit file damaged now too: the read's own error says enough
            return e
        if gone:
            self._readers.pop(shard, None)
            return self._gone(shard)
        return e

    @property
    def store(self) -> HiddenStore:
        if self._store is None or self._pid != os.getpid():  # first read, or a forked worker's first
            self._store = HiddenStore(self.location, node_cache=self.node_cache)
            self._pid, self._readers = os.getpid(), {}
        return self._store

    def __getitem__(self, key: int | list[Row]) -> Batch:
        """key: the index of a batch in `batches`, or the batch itself (its rows), as the loader
        sends them to its workers."""
        rows = self.batches[key] if isinstance(key, int) else key
        lengths = [sum(r.length for r in row) for row in rows]
        T, b = max(lengths), len(rows)
        states = (len(self.store.attrs.taps), self.store.attrs.hidden_size)
        out = Batch(
            tokens=torch.zeros(b, T, dtype=torch.long),
            loss_mask=torch.zeros(b, T, dtype=torch.bool),
            hidden=torch.zeros(b, T, *states, dtype=torch.bfloat16),
            lengths=torch.tensor(lengths),
            refs=torch.tensor([[r.shard, r.index] for row in rows for r in row]),
            starts=torch.zeros(b, T, dtype=torch.long),
            final=torch.zeros(b, T, states[1], dtype=torch.bfloat16) if self.final_state else None,
        )
        corrupt, places, items = [], [], []
        for j, row in enumerate(rows):
            at = 0
            for r in row:  # states decoded straight into the batch: no copy per sample
                span = slice(at, at + r.length)
                out.starts[j, span] = at
                at += r.length
                try:
                    items.append((self.reader(r.shard), r.index, r.length, out.hidden[j, span]))
                    places.append((j, span, r))
                except StoreError as e:
                    corrupt.append((r.shard, r.index, str(e)))
                    out.lengths[j] -= r.length
        for (j, span, r), s in zip(
            places, read_samples(items, self.final_state)
        ):  # the batch's requests in flight together
            if isinstance(s, StoreError):  # damaged, or deleted under the run: its span stays empty (no tokens,
                # no loss, seen by no other sample), and the main process decides
                out.hidden[j, span] = 0
                out.lengths[j] -= r.length
                corrupt.append((r.shard, r.index, str(self._why(r.shard, s))))
            elif isinstance(s, Exception):
                raise s
            else:
                out.tokens[j, span], out.loss_mask[j, span] = s.tokens, s.loss_mask
                if out.final is not None:
                    out.final[j, span] = s.final_state
        out.corrupt = tuple(corrupt)
        out.cache_trouble = None if self.node_cache is None else self.node_cache.trouble
        return out

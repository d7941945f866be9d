"""Training data order and batches, straight from the store.

`index_samples` lists the trainable samples of the chosen shards (lengths only, no hidden
states). `epoch_batches` orders them for one epoch: shuffled by sample with a (seed, epoch)
generator, bucketed by length so padding stays small, cut into batches, and dealt to ranks so
each rank reads only its own part. `StoreBatches` turns a batch of sample refs into padded
tensors; it is what DataLoader worker processes run, each with its own store handles.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np
import torch

from store import layout
from store.errors import NotCommitted, StoreCorrupt, StoreError
from store.hidden_store import HiddenStore
from store.shard_reader import ShardReader

BUCKET = 64  # batches of similar length are formed within windows of this many batches


@dataclass(frozen=True)
class Ref:
    shard: int
    index: int
    length: int  # tokens used (after --max-length)


def index_samples(store: HiddenStore, shards: list[int], max_length: int) -> list[Ref]:
    """Samples with at least one anchor (pipeline/drafter/blocks.py) within max_length, from the
    per-sample index: O(samples) bytes read, not the per-token mask. The first anchor of a sample
    is its first pair of loss tokens (the anchor rule, checked against `anchor_mask` in the tests),
    so an anchor lies within n tokens iff that pair does."""
    store.require_committed(shards)
    refs = []
    for shard in shards:
        reader = ShardReader(store, shard)
        lengths = np.diff(reader.offsets)
        for i, (length, first) in enumerate(zip(lengths, reader.first_pairs)):
            n = min(int(length), max_length)
            if 0 <= first and first + 2 <= n:
                refs.append(Ref(shard, i, n))
    return refs


def sample_refs(refs: list[Ref], n: int | None, seed: int) -> list[Ref]:
    """A fixed uniform sample of n refs (all when n is None or not smaller), in store order: the
    held-out samples validation checks on every call."""
    if n is None or n >= len(refs):
        return refs
    return [refs[i] for i in np.sort(np.random.default_rng([seed, 1]).choice(len(refs), n, replace=False))]


def epoch_batches(refs: list[Ref], batch_size: int, seed: int, epoch: int, rank: int = 0,
                  world: int = 1) -> list[list[Ref]]:
    """This rank's batches for one epoch; every rank gets the same number (the tail is dropped)."""
    g = np.random.default_rng([seed, epoch])
    order = g.permutation(len(refs))
    window = batch_size * BUCKET
    batches = []
    for lo in range(0, len(order), window):
        part = sorted(order[lo:lo + window], key=lambda i: refs[i].length)
        batches += [[refs[i] for i in part[j:j + batch_size]] for j in range(0, len(part), batch_size)]
    batches = [batches[i] for i in g.permutation(len(batches))]
    per_rank = len(batches) // world
    return batches[rank * per_rank:(rank + 1) * per_rank]


@dataclass
class Batch:
    tokens: torch.Tensor  # [b, T] long, 0 past each length
    loss_mask: torch.Tensor  # [b, T] bool, False past each length
    hidden: torch.Tensor  # [b, T, n_taps, H] bf16, 0 past each length
    lengths: torch.Tensor  # [b] long
    refs: torch.Tensor  # [b, 2] long: (shard, index)
    corrupt: tuple = ()  # (shard, index, why) of the rows left empty: their read failed (damaged or missing)

    def _map(self, fn) -> "Batch":
        values = (getattr(self, f.name) for f in fields(self))
        return Batch(*(fn(v) if isinstance(v, torch.Tensor) else v for v in values))

    def pin_memory(self) -> "Batch":
        return self._map(torch.Tensor.pin_memory)

    def to(self, device) -> "Batch":
        return self._map(lambda t: t.to(device, non_blocking=True))


class StoreBatches(torch.utils.data.Dataset):
    """batches[i] -> a padded Batch. Store handles open lazily, once per worker process."""

    def __init__(self, location: str, batches: list[list[Ref]]) -> None:
        self.location, self.batches = location, batches
        self._store: HiddenStore | None = None
        self._readers: dict[int, ShardReader] = {}

    def __len__(self) -> int:
        return len(self.batches)

    def reader(self, shard: int) -> ShardReader:
        if shard not in self._readers:
            try:
                self._readers[shard] = ShardReader(self.store, shard)
            except NotCommitted:  # it was committed when the run indexed it
                raise StoreCorrupt(f"{self.store.path(layout.commit_key(shard))}: gone since the run started (shard "
                                   f"{shard} was deleted or cleared under it)", self.store.redo_hint(shard)) from None
        return self._readers[shard]

    @property
    def store(self) -> HiddenStore:
        if self._store is None:
            self._store = HiddenStore(self.location)
        return self._store

    def __getitem__(self, i: int) -> Batch:
        refs = self.batches[i]
        T, b = max(r.length for r in refs), len(refs)
        states = (len(self.store.attrs.taps), self.store.attrs.hidden_size)
        out = Batch(tokens=torch.zeros(b, T, dtype=torch.long), loss_mask=torch.zeros(b, T, dtype=torch.bool),
                    hidden=torch.zeros(b, T, *states, dtype=torch.bfloat16),
                    lengths=torch.tensor([r.length for r in refs]),
                    refs=torch.tensor([[r.shard, r.index] for r in refs]))
        corrupt = []
        for j, r in enumerate(refs):  # states decoded straight into the batch: no copy per sample
            try:
                s = self.reader(r.shard).read(r.index, r.length, hidden_out=out.hidden[j, :r.length])
            except StoreError as e:  # damaged, or deleted under the run: the row stays empty (no tokens, no
                # loss), and the main process decides
                out.hidden[j].zero_()
                out.lengths[j] = 0
                corrupt.append((r.shard, r.index, str(e)))
                continue
            out.tokens[j, :r.length], out.loss_mask[j, :r.length] = s.tokens, s.loss_mask
        out.corrupt = tuple(corrupt)
        return out
